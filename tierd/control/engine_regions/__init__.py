"""Engine host regions, the daemon's side: an engine's own memory handed over once as a
descriptor (:mod:`~tierd.control.engine_regions.descriptor`,
:mod:`~tierd.control.engine_regions.registration`), a connection's table of them, and
the store and load jobs over them (:mod:`~tierd.control.engine_regions.requests`) with
the bytes they move (:mod:`~tierd.control.engine_regions.byte_moves`)."""
