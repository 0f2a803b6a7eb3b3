"""What the benchmark scripts in experiments/ share: the FFN cases and their timer
(``ffn_cases``), the model benchmark's settings, calibration and timing helpers
(``model_bench``) and the GPU power sampler (``power``)."""
