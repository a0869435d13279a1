"""The schema's sections of how a run trains: the optimizer and its settings, the training loop, the loss, EMA,
precision, LoRA and embeddings (torch-free; :mod:`trainer.config.schema` holds them in ``AtelierConfig``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from trainer.config.declare import f
from trainer.optim.registry import OPTIMIZER_NAMES, SCHEDULER_NAMES, used_by  # torch-free registry tables


def _opt(default: Any, help: str, setting: str, **kw: Any) -> Any:
    """An optimizer setting; its help text ends with the optimizers that take it (from trainer.optim)."""
    return f(default, f"{help} {used_by(setting)}".strip(), **kw)


@dataclass
class OptimizerConfig:
    """Settings of every optimizer in trainer.optim.registry.OPTIMIZERS; each one takes only some of them
    (trainer.optim.registry.optimizer_fields). Blank (null) = the optimizer's own default."""
    name: str = f("adamw", "Optimizer (torch, bitsandbytes 8-bit, prodigyopt, pytorch-optimizer, transformers). "
                           "Prodigy/D-Adaptation want LR 1; *8bit need bitsandbytes.", choices=OPTIMIZER_NAMES)
    weight_decay: Optional[float] = _opt(None, "Weight decay; blank = the optimizer's default (AdamW 0.01, "
                                               "most others 0).", "weight_decay", min=0.0, max=10.0)
    beta1: Optional[float] = _opt(None, "First-moment (momentum) decay; blank = default (0.9 for most). "
                                        "Adafactor: blank = no first moment (least memory).", "beta1",
                                  min=0.0, max=1.0)
    beta2: Optional[float] = _opt(None, "Second-moment decay; blank = default (0.999 Adam, 0.99 Lion).", "beta2",
                                  min=0.0, max=1.0)
    beta3: Optional[float] = _opt(None, "Third beta: Prodigy's d-estimate decay (blank = sqrt(beta2)); "
                                        "CAME/AdEMAMix/DAdapt-Adan's third moment.", "beta3", min=0.0, max=1.0)
    eps: Optional[float] = _opt(None, "Numerical epsilon (Adafactor/CAME: the first, eps1); blank = default.",
                                "eps", min=0.0, max=1.0)
    eps2: Optional[float] = _opt(None, "Second epsilon (Adafactor: parameter-scale floor 1e-3; CAME 1e-16); "
                                       "blank = default.", "eps2", min=0.0, max=1.0)
    momentum: Optional[float] = _opt(None, "Momentum; blank = default (SGD/RMSprop 0, LARS/DAdapt-SGD 0.9). "
                                           "sgd8bit and lars8bit need > 0.", "momentum", min=0.0, max=1.0)
    nesterov: bool = _opt(False, "Nesterov momentum.", "nesterov")
    amsgrad: bool = _opt(False, "AMSGrad variant (keeps the max of the second moment).", "amsgrad")
    decouple: bool = _opt(True, "Decoupled (AdamW-style) weight decay instead of L2.", "decouple")
    centered: bool = _opt(False, "Centered RMSprop (normalise by the gradient's variance).", "centered")
    rmsprop_alpha: Optional[float] = _opt(None, "RMSprop smoothing constant; blank = 0.99.", "rmsprop_alpha",
                                          min=0.0, max=1.0)
    lars_trust_coefficient: Optional[float] = _opt(None, "LARS trust coefficient; blank = 0.001.",
                                                   "lars_trust_coefficient", min=0.0, max=1.0)
    ademamix_alpha: Optional[float] = _opt(None, "AdEMAMix weight of the slow EMA; blank = 5.", "ademamix_alpha",
                                           min=0.0, max=1000.0)
    # Prodigy / D-Adaptation
    d0: float = _opt(1e-6, "Initial step-size estimate D (Prodigy/D-Adaptation).", "d0", min=1e-12, max=1.0)
    d_coef: float = _opt(1.0, "Multiplier on Prodigy's estimated step size: <1 weaker, >1 stronger "
                              "(use this, not the LR).", "d_coef", min=0.0, max=1000.0)
    growth_rate: Optional[float] = _opt(None, "How fast D may grow per step (e.g. 1.02); blank = unlimited.",
                                        "growth_rate", min=1.0, max=1e6)
    use_bias_correction: bool = _opt(False, "Adam-style bias correction (Prodigy: recommended on for "
                                            "diffusion LoRA by some guides).", "use_bias_correction")
    safeguard_warmup: bool = _opt(False, "Keep the LR out of the D estimate's denominator: turn on when "
                                         "using an LR warm-up.", "safeguard_warmup")
    slice_p: int = _opt(1, "Estimate D from every p-th element (saves memory; 11 is typical).", "slice_p",
                        min=1, max=1024)
    d_limiter: bool = _opt(True, "Limit how fast D grows (stabler).", "d_limiter")
    prodigy_steps: int = _opt(0, "Stop adapting D after this many steps; 0 = never.", "prodigy_steps",
                              min=0, max=10**8)
    split_groups: bool = _opt(True, "A separate D per parameter group (UNet, text encoder).", "split_groups")
    factored: bool = _opt(True, "Factored second moment (Adafactor-style, less memory).", "factored")
    use_stableadamw: bool = _opt(True, "StableAdamW update clipping (no gradient clipping needed).",
                                 "use_stableadamw")
    # Adafactor / CAME
    relative_step: bool = _opt(True, "Adafactor computes its own LR from the step count (adaptive mode; use "
                                     "lr_scheduler = adafactor). Off = a fixed LR from training.learning_rate.",
                               "relative_step")
    scale_parameter: bool = _opt(True, "Scale the step by each parameter's RMS (adaptive mode); off for the "
                                       "low-memory AdamW-like mode.", "scale_parameter")
    warmup_init: bool = _opt(False, "Adafactor's own warm-up of the relative step (needs relative_step).",
                             "warmup_init")
    clip_threshold: Optional[float] = _opt(None, "Update RMS clipping threshold; blank = 1.", "clip_threshold",
                                           min=0.0, max=1e6)
    decay_rate: Optional[float] = _opt(None, "Adafactor second-moment decay exponent; blank = -0.8.",
                                       "decay_rate", min=-1.0, max=0.0)
    extra_args: Dict[str, Any] = f(help="More constructor arguments, passed as-is (YAML mapping, e.g. "
                                        "{use_cautious: true}); they win over the fields above.", factory=dict)


@dataclass
class TrainingConfig:
    method: str = f("lora", "What to train: a LoRA adapter (or LoHa/LoKr/DoRA, see lora.type), the whole "
                            "model, or a textual-inversion embedding.",
                    choices=["lora", "finetune", "embedding"])
    epochs: int = f(10, "Passes over the data (ignored when max_steps > 0).", min=1, max=100000)
    max_steps: int = f(0, "Stop after this many optimizer steps; 0 = use epochs.", min=0, max=10**8)
    batch_size: int = f(1, "Images per step.", min=1, max=1024)
    gradient_accumulation_steps: int = f(1, "Batches summed into one optimizer step.", min=1, max=1024)
    max_grad_norm: float = f(1.0, "Clip gradients to this norm; 0 = no clipping.", min=0.0, max=1e6)
    mixed_precision: str = f("no", "Autocast precision for the forward pass.",
                             choices=["no", "fp16", "bf16"])
    adapter_compute_copies: bool = f(True, "bf16, or fp16 on a GPU: plain LoRA weights are computed from copies "
                                           "in that dtype kept in the layers, the fp32 weights stay the optimizer's "
                                           "masters (fewer casts a step, the same values). One process.")
    norms_in_compute_dtype: bool = f(True, "bf16, or fp16 on a GPU: the denoiser's RMSNorms (the q/k norms of the "
                                           "transformer families) whose weights are stored in that dtype run as one "
                                           "fused F.rms_norm outside autocast and return that dtype, as the models' "
                                           "own code and ComfyUI run them. Off: CUDA autocast's fp32 norms, as "
                                           "diffusers' example scripts run them (an fp32 copy of each norm's input "
                                           "kept for backward; diffusers' RMSNorm as ~8 kernels, not one).")
    gradient_checkpointing: bool = f(False, "Trade compute for memory: recompute activations.")
    gradient_checkpointing_interval: int = f(1, "With gradient checkpointing: checkpoint every Nth block only; the "
                                                "others keep their activations for backward (less recomputation, "
                                                "more memory: estimate-vram counts it). 1 = every block. As "
                                                "SimpleTuner's --gradient_checkpointing_interval.", min=1, max=1000)
    checkpoint_keep_attention: bool = f(False, "With gradient checkpointing: keep each block's attention output "
                                               "for backward instead of computing attention again there. Pays "
                                               "for long sequences (video clips, large images), where attention "
                                               "dominates; costs memory (one attention output per block, counted "
                                               "by estimate-vram) and host time (Python for every op of a "
                                               "checkpointed block), which short sequences may not win back.")
    compile: bool = f(False, "torch.compile the denoiser's repeated blocks (regional: one compile per block "
                             "type; or the whole denoiser, training.compile_scope), compiled at the first step "
                             "(tens of seconds to minutes). On an H200 (docs/performance.md) compiling sped "
                             "Flux.1 and SDXL LoRA steps up and slowed SD 1.5's in the default mode, where "
                             "compile_mode reduce-overhead ran 1.95x eager: try a few steps each way on your "
                             "card. What it compiles is kept in the caches' folder (cache/torch-compile): a later "
                             "run of the same model and shapes loads it instead. "
                             "Needs Triton on NVIDIA GPUs (on Windows the triton-windows package) and a C++ "
                             "compiler on the CPU.")
    compile_mode: str = f("default", "torch.compile's mode for training.compile: reduce-overhead and max-autotune also "
                                     "record CUDA graphs (one per bucket shape and block; CUDA only, not with "
                                     "gradient checkpointing); max-autotune-no-cudagraphs tunes kernels longer.",
                          choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
    compile_dynamic: str = f("auto", "training.compile's input sizes: auto (torch's default: a block class compiles "
                                     "for its first input shape, then once more with the sizes that changed "
                                     "symbolic, which serves every size after), static (one graph per input shape: "
                                     "each UNet level and bucket compiled for its own sizes: more graphs, each "
                                     "made for its sizes) or dynamic (symbolic sizes from the start). musubi-tuner's "
                                     "--compile_dynamic auto / false / true.", choices=["auto", "static", "dynamic"])
    compile_scope: str = f("blocks", "What training.compile compiles: blocks (each repeated block in place, one "
                                     "compile per block class and shape, as OneTrainer and musubi-tuner compile) or "
                                     "denoiser (the whole UNet or transformer as one graph, as kohya's sd-scripts "
                                     "compiles it with --torch_compile: the fewest host calls a step, and with "
                                     "compile_mode reduce-overhead one CUDA graph for the whole forward and one "
                                     "for backward; its compile takes minutes, each new step shape compiles the "
                                     "whole graph again, and samples and validation run it eagerly). denoiser not "
                                     "with swapped blocks or FSDP.",
                           choices=["blocks", "denoiser"])
    learning_rate: float = f(1e-4, "Base learning rate.", min=0.0, max=10.0)
    embedding_learning_rate: Optional[float] = f(None, "Learning rate of trained embeddings (textual inversion); "
                                                       "blank = the base rate.", min=0.0, max=10.0)
    embedding_stop_after_steps: int = f(0, "Train the embeddings only for the first N optimizer steps; 0 = the "
                                           "whole run.", min=0, max=10**8)
    embedding_stop_after_epochs: int = f(0, "Train the embeddings only for the first N epochs; 0 = the whole "
                                            "run.", min=0, max=100000)
    scale_lr: str = f("none", "Scale every learning rate by the effective batch (batch_size x "
                              "gradient_accumulation_steps x processes): linear (x batch) or sqrt (x sqrt(batch)).",
                      choices=["none", "linear", "sqrt"])
    fused_backward: bool = f(False, "Fused backward pass: step each weight as soon as its gradient is ready and "
                                    "free the gradient (less memory). Needs gradient_accumulation_steps = 1, "
                                    "max_grad_norm = 0 and an optimizer that steps per weight (adamw, adam, sgd, "
                                    "adafactor, ...).")
    validation_every_n_steps: int = f(0, "Measure the loss of validation concepts every N steps; 0 = at the end "
                                         "of each epoch (only when a concept is marked validation).",
                                      min=0, max=10**7)
    lr_scheduler: str = f("constant", "Learning-rate schedule (trainer.optim.registry.SCHEDULERS): cosine_with_restarts "
                                      "rises back smoothly; cosine_with_hard_restarts jumps back (kohya's "
                                      "cosine_with_restarts); rex takes no warm-up; custom = lr_scheduler_class.",
                          choices=SCHEDULER_NAMES)
    lr_warmup_steps: int = f(0, "Warm-up: optimizer steps of linear LR ramp at the start (0 = none).",
                             min=0, max=10**7)
    lr_warmup_fraction: float = f(0.0, "Warm-up as a fraction of all steps (e.g. 0.05); use instead of "
                                       "lr_warmup_steps (keep that 0).", min=0.0, max=1.0)
    lr_cycles: int = f(1, "Cycles of cosine_with_restarts / cosine_with_hard_restarts.", min=1, max=1000)
    lr_min_factor: float = f(0.0, "Decaying schedules never go below this fraction of the LR (linear, cosine*, "
                                  "polynomial: the end LR, rex).", min=0.0, max=1.0)
    lr_power: float = f(1.0, "Exponent of the polynomial schedule (1 = linear).", min=0.0, max=100.0)
    lr_step_rules: str = f("1:1000,0.1", "piecewise_constant: 'multiplier:until_step,...,final_multiplier'.")
    lr_scheduler_class: str = f("", "lr_scheduler = custom: the scheduler class or factory, "
                                    "'package.module:Class' (e.g. torch.optim.lr_scheduler:OneCycleLR).")
    lr_scheduler_args: Dict[str, Any] = f(help="lr_scheduler = custom: its keyword arguments (YAML mapping); "
                                               "num_training_steps/total_steps/num_warmup_steps are filled in "
                                               "when it takes them.", factory=dict)
    noise_offset: float = f(0.0, "Noise offset (brighter darks / darker lights); 0.05–0.1 is typical.",
                            min=0.0, max=1.0)
    optimizer: OptimizerConfig = f(help="Optimizer and its settings.", factory=OptimizerConfig)


@dataclass
class LossConfig:
    vb_strength: float = f(1.0, "Models with a learned variance (PixArt): weight of the variational-bound loss that "
                                "trains the variance half of the output, as PixArt was trained and OneTrainer "
                                "does (1); 0 leaves it as it is. No effect on other models.", min=0.0, max=100.0)
    type: str = f("mse", "Loss between prediction and target: MSE, MAE (L1), or kohya's pseudo-Huber forms "
                         "huber (≈MSE for small errors, linear for large) and smooth_l1.",
                  choices=["mse", "mae", "huber", "smooth_l1"])
    huber_delta: float = f(0.1, "Huber/smooth-L1 threshold δ (kohya's huber_c): errors beyond it count "
                                "linearly. With a schedule, the value reached at the noisiest timestep.",
                           min=1e-4, max=100.0)
    huber_schedule: str = f("snr", "Huber δ over timesteps: constant, or exponential / snr (from 1 at low noise "
                                   "down to huber_delta at high noise: scheduled pseudo-Huber).",
                            choices=["constant", "exponential", "snr"])
    min_snr_gamma: float = f(0.0, "Min-SNR-γ weighting: caps the weight of low-noise timesteps "
                                  "(5 is typical); 0 = off. Handles epsilon and v-prediction.",
                             min=0.0, max=100.0)
    debiased_estimation: bool = f(False, "Debiased estimation: weight timesteps by 1/√SNR (epsilon) or "
                                         "1/(SNR+1) (v-prediction), as kohya does.")
    input_perturbation: float = f(0.0, "Input perturbation noise: extra noise on the model's input only "
                                       "(0.1 is typical); 0 = off.", min=0.0, max=1.0)
    zero_terminal_snr: bool = f(False, "Rescale the noise schedule so the last timestep is pure noise; wants "
                                       "v-prediction. Samplers use it too (trailing timesteps).")
    timestep_min: int = f(0, "Lowest timestep trained (inclusive).", min=0, max=10000)
    timestep_max: int = f(1000, "Timesteps are drawn below this (exclusive); capped at the model's count.",
                          min=1, max=10000)
    timestep_distribution: str = f("auto", "How timesteps are drawn in the range: uniform, logit_normal (favours "
                                           "the middle), mode (SD3 mode sampling), or auto: the model's own — "
                                           "logit_normal for SD3/3.5 (as diffusers' and kohya's SD3 trainers), "
                                           "uniform for the others.",
                                   choices=["auto", "uniform", "logit_normal", "mode"])
    logit_mean: float = f(0.0, "logit_normal: mean of the normal before the sigmoid (0 = the middle).",
                          min=-10.0, max=10.0)
    logit_std: float = f(1.0, "logit_normal: spread of the normal before the sigmoid.", min=0.01, max=10.0)
    mode_scale: float = f(1.29, "mode: how strongly the middle is favoured (−1 to 1.75; 0 = uniform).",
                          min=-1.0, max=1.75)
    flow_shift: float = f(0.0, "Flow-matching families (Flux …): timestep shift s (σ' = sσ/(1+(s−1)σ); 3 is "
                               "kohya's default); 0 = the model's own fixed shift (SD3, Z-Image), none for the models "
                               "whose sampler shifts by the image size (as diffusers' trainers draw).",
                          min=0.0, max=100.0)
    resolution_shift: bool = f(False, "Flux.1 dev/Kontext, Chroma, Qwen-Image: shift the training σ by the image "
                                      "size's μ, as their pipelines sample (kohya's --timestep_sampling flux_shift, "
                                      "with timestep_distribution logit_normal); off = unshifted, as diffusers' Flux "
                                      "and Qwen-Image trainers draw. loss.flow_shift > 0 wins.")
    precondition_outputs: bool = f(False, "Flow-matching families: compare x̂0 = x_σ − σ·v̂ with the clean latents "
                                          "instead of v̂ with ε − x (the velocity loss weighted by σ²), as diffusers' "
                                          "SD3 trainer (--precondition_outputs, its default) and kohya's do; off = "
                                          "the plain velocity loss (diffusers' Flux trainers).")
    cosine_timesteps: str = f("uniform", "Würstchen 2 / Stable Cascade: t uniform in the range (diffusers' trainers), "
                                         "or original: the original recipe's draw, as OneTrainer has it (Würstchen 2: "
                                         "t·1.08 + 0.001, Stable Cascade: t + 0.001, clamped to [0.001, 1]).",
                              choices=["uniform", "original"])
    flow_weighting: str = f("none", "Flow-matching families: SD3-style loss weighting over σ (diffusers' "
                                    "compute_loss_weighting_for_sd3): none, sigma_sqrt or cosmap.",
                            choices=["none", "sigma_sqrt", "cosmap"])
    unmasked_weight: float = f(0.1, "Masked training: loss weight outside the mask (0 = ignore, 1 = no mask).",
                               min=0.0, max=1.0)
    unmasked_probability: float = f(0.1, "Masked training: fraction of steps that ignore the mask.",
                                    min=0.0, max=1.0)
    normalize_masked_area_loss: bool = f(False, "Masked training: divide each image's loss by its mask's "
                                                "mean, so small masks are not under-weighted.")


@dataclass
class EmaConfig:
    enabled: bool = f(False, "Keep an exponential moving average of the trained weights.")
    decay: float = f(0.999, "EMA decay per update: the average spans about 1/(1−decay) updates.",
                     min=0.0, max=1.0)
    warmup: bool = f(True, "Ramp the decay up as (1+n)/(10+n) over the first updates (diffusers' EMA), so "
                           "early weights do not dominate.")
    update_every_n_steps: int = f(1, "Update the EMA every N optimizer steps.", min=1, max=100000)
    device: str = f("cpu", "Where the EMA copy lives: cpu (saves GPU memory) or the training device (faster).",
                    choices=["cpu", "same"])
    sample_with: str = f("both", "Samples from the EMA weights, the raw weights, or both (EMA files end in "
                                 "-ema).", choices=["ema", "raw", "both"])
    save_ema: bool = f(True, "Save the EMA weights as the result (off = the raw weights).")


@dataclass
class PrecisionConfig:
    stochastic_rounding: bool = f(False, "bf16 weights: round each optimizer update stochastically, so updates "
                                         "smaller than bf16's step are not lost (fine-tunes in bf16).")


@dataclass
class LoraConfig:
    type: str = f("lora", "Adapter kind: LoRA (LoCon when conv layers are targeted), DoRA (LoRA with "
                          "weight decomposition), LoHa (Hadamard product) or LoKr (Kronecker product). "
                          "LoRA/LoCon files load in ComfyUI, Forge, A1111 and diffusers; DoRA exactly in the "
                          "loader output.dora_format names; LoHa/LoKr (LyCORIS format) in ComfyUI, Forge and "
                          "A1111 but not diffusers. OFT (orthogonal fine-tuning: each layer's outputs rotated in "
                          "blocks of lora.rank, LyCORIS diag-OFT file) in ComfyUI.",
                  choices=["lora", "dora", "loha", "lokr", "oft"])
    rank: int = f(16, "LoRA rank (dim): capacity of the adapter.", min=1, max=1024)
    alpha: float = f(16.0, "LoRA alpha: the update is scaled by alpha/rank.", min=0.0, max=4096.0)
    conv_rank: Optional[int] = f(None, "Rank of k×k conv layers (LoCon's conv_dim); blank = rank.",
                                 min=1, max=1024)
    conv_alpha: Optional[float] = f(None, "Alpha of k×k conv layers (conv_alpha); blank = alpha.",
                                    min=0.0, max=4096.0)
    dropout: float = f(0.0, "Dropout on the adapter's input (LoRA and DoRA).", min=0.0, max=1.0)
    rank_dropout: float = f(0.0, "LoHa/LoKr: probability of dropping each output row of the update.",
                            min=0.0, max=1.0)
    module_dropout: float = f(0.0, "LoHa/LoKr: probability of skipping a whole layer's update in a step.",
                              min=0.0, max=1.0)
    custom_targets: List[str] = f(help="With parts.denoiser.lora_targets = custom: denoiser module names to adapt — name "
                                       "endings such as to_q, attn2.to_k, ff.net.2, conv1, or regular "
                                       "expressions prefixed with re: matched against the whole path "
                                       "(re:.*up_blocks\\.[12].*to_[qkv]).", factory=list)
    factor: int = f(-1, "LoKr: Kronecker factor of each dimension; -1 = as balanced as possible.",
                    min=-1, max=4096)
    decompose_both: bool = f(False, "LoKr: also make the smaller Kronecker factor low-rank.")
    lokr_full_matrix: bool = f(False, "LoKr: keep the larger Kronecker factor a full matrix whatever the rank "
                                      "(LyCORIS' full_matrix; OneTrainer's lokr_full_matrix, ai-toolkit's "
                                      "lokr_full_rank): both factors full, lora.rank unused, the size set by "
                                      "lora.factor.")
    loraplus_lr_ratio: Optional[float] = f(None, "LoRA+: B (lora_up) learns at this many times the learning rate "
                                                 "(kohya's loraplus_lr_ratio; the paper suggests 16); blank = off. "
                                                 "LoRA and DoRA.", min=1.0, max=1000.0)
    loraplus_text_encoder_lr_ratio: Optional[float] = f(None, "LoRA+ ratio of the text encoders' adapters "
                                                              "(kohya's loraplus_text_encoder_lr_ratio); blank = "
                                                              "loraplus_lr_ratio.", min=1.0, max=1000.0)
    init_weights: str = f("", "Start from an existing adapter .safetensors (kohya LoRA/DoRA or LyCORIS "
                              "LoHa/LoKr layout, matching lora.type).", ui="path")


@dataclass
class EmbeddingConfig:
    placeholder: str = f("", "The new word the embedding learns, as written in captions and prompts "
                             "(e.g. <sks>); it is expanded to num_vectors new tokens.")
    num_vectors: int = f(1, "Tokens (vectors) the embedding uses; more = more capacity, less room in "
                            "the 75-token prompt.", min=1, max=75)
    initial_text: str = f("*", "Start the vectors from these words' embeddings (repeated or cut to "
                               "num_vectors); empty = zeros.")
    train_alongside: bool = f(False, "Also train this embedding alongside a LoRA or fine-tune "
                                     "(training.method lora/finetune); saved next to the result.")
    bundle: bool = f(False, "With train_alongside and a LoRA: also store the embedding inside the LoRA "
                            "file (bundle_emb.*, read by A1111). diffusers' load_lora_weights refuses such "
                            "files; the separate embedding file is always written too.")
    save_pt: bool = f(False, "Also write the embedding as an A1111 .pt file.")
    init_weights: str = f("", "Start from an existing embedding file (A1111 .safetensors/.pt).", ui="path")
