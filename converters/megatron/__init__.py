"""Megatron-LM and Megatron-Core checkpoints.

- :mod:`~converters.megatron.legacy`: ``iter_*/mp_rank_*/model_optim_rng.pt`` (format ``megatron``).
- :mod:`~converters.megatron.optimizer`: the non-distributed optimizer in those files.
- :mod:`~converters.megatron.distopt`: the distributed optimizer's ``distrib_optim.pt``.
- :mod:`~converters.megatron.dist`: Megatron-Core ``torch_dist`` (format ``megatron-dist``).
- :mod:`~converters.megatron.dist_distopt`: the distributed optimizer inside ``torch_dist``.
- :mod:`~converters.megatron.zarr`: Megatron-Core's ``zarr`` backend (format ``megatron-zarr``, read only).
- :mod:`~converters.megatron.common`: ``metadata.json``/``common.pt``, shared by torch_dist and zarr.
"""
