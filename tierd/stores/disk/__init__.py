"""The disk store, by concept: the store (:mod:`~tierd.stores.disk.store`), one slab file
and its slot index (:mod:`~tierd.stores.disk.slab`), a block's on-disk format and the
rule of recovery (:mod:`~tierd.stores.disk.block_format`), the index in memory, its
snapshot format and the walk that takes one (:mod:`~tierd.stores.disk.index`), the
journal (:mod:`~tierd.stores.disk.journal`), when checkpoints are taken while serving
(:mod:`~tierd.stores.disk.checkpoints`), what opening a slab finds
(:mod:`~tierd.stores.disk.opening`), the file calls and ``fsync`` modes
(:mod:`~tierd.stores.disk.io`) and a batch's chunks on the I/O threads
(:mod:`~tierd.stores.disk.threads`)."""
