"""The diffusion stage engine: denoising one step at a time for a batch of requests.

    engine.py       DiffusionEngine (the StageEngine of `stage_type: diffusion` stages)
    scheduler.py    which requests share a step (FCFS, one batch key at a time)
    request.py      one request's state and its flow-matching (Euler) update
    denoise.py      the denoiser forward of a step, classifier-free guidance
    (the model's side: model_executor/models/diffusion_model.py, Qwen-Image: models/qwen_image)
    tea_cache.py    TeaCache, per row
    db_cache.py     cache-dit's DBCache (--cache-backend cache_dit), per row
    process_group.py the stage's other ranks (torch.distributed): CFG parallelism, sequence
                    parallelism, HSDP, patch-parallel VAE decode
    rank_groups.py  the groups of one rank in that world
    diffusers_engine.py   any other diffusers pipeline, one whole call per request

See docs/diffusion.md.
"""
