"""The sampling schedulers a DDPM-trained family offers (``sampling.scheduler``), by diffusers class name."""

SAMPLERS = {  # sampling.scheduler → diffusers scheduler class
    "ddim": "DDIMScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "dpmpp_2m": "DPMSolverMultistepScheduler",
}
