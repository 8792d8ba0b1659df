"""The daemon's socket side: the listener (:mod:`~tierd.control.serving.server`), one
connection's frames in and replies out (:mod:`~tierd.control.serving.connection`) with
the guards on what it may hold and for how long, and its session
(:mod:`~tierd.control.serving.session`), which checks each request and hands it to the
module of :mod:`~tierd.control.requests` or :mod:`~tierd.control.engine_regions` that
answers it."""
