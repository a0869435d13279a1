"""The one configuration schema of Atelier: every knob is a field of a dataclass, with a default and ``metadata``
(:func:`trainer.config.declare.f`: help text, choices, range, a UI hint). :class:`AtelierConfig` is the whole of
it; the sections of how a run trains (optimizer, training, loss, EMA, precision, LoRA, embedding) are declared in
``trainer.config.schema_training``.

The ground floor of the configuration: torch-free, so the CLI's ``--help``/``validate`` and the UI's first
paint use it without torch. Of Atelier it imports only the two torch-free registries its choices come from
(optimizer and scheduler names, model families): each is a table that imports nothing above it.
``trainer.config.load`` builds a config from presets, files and ``--set``; ``trainer.config.checks`` checks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from trainer.config.declare import DTYPES, f
from trainer.config.schema_training import (
    EmaConfig,
    EmbeddingConfig,
    LoraConfig,
    LossConfig,
    PrecisionConfig,
    TrainingConfig,
)
from trainer.families import family_choices  # torch-free registry: model.family's choices

CONFIG_VERSION = 3

# --------------------------------------------------------------------------------------------
# sections
# --------------------------------------------------------------------------------------------

@dataclass
class GeneralConfig:
    workspace: str = f("workspace", "Folder that holds runs/, caches and built-in models.", ui="path")
    run_name: str = f("", "Name of the run folder under <workspace>/runs/; empty = a timestamped name.")
    seed: int = f(42, "Random seed: same seed and data give the same run.", min=0, max=2**32 - 1)
    device: str = f("auto", "Where to train: auto picks a CUDA/ROCm GPU when present, else Apple's MPS "
                            "(Apple Silicon), else the CPU.",
                    choices=["auto", "cuda", "cpu", "mps"])
    tensorboard: bool = f(True, "Write TensorBoard logs to <run>/tensorboard.")
    sized_for: str = f("", "The memory-tier preset this config was sized with (the *-<N>gb presets set it): validate "
                           "warns at each memory setting changed to need more than that preset's. Empty = no check.")
    dataloader_workers: int = f(2, "Batches loaded ahead in background threads (0 = load in the main thread).",
                                min=0, max=64)
    num_processes: int = f(1, "Training processes, one per GPU (DDP through accelerate); more than 1 launches "
                              "through accelerate. Effective batch = batch_size x accumulation x processes.",
                           min=1, max=64)
    gpu_ids: str = f("", "GPUs to train on, e.g. 0,1 (one process each, so num_processes = how many); one id "
                         "with num_processes 1 trains on that GPU; empty = the first num_processes GPUs.")
    dist_timeout_s: int = f(1800, "Seconds a process waits for the others (a dead or stuck process, or rank 0 "
                                  "caching or sampling) before the job fails.", min=30, max=86400)
    distributed: str = f("ddp", "Several processes: ddp = every process holds the whole model; fsdp = a full "
                                "fine-tune shards the UNet's weights, gradients and optimizer state over the "
                                "processes (accelerate FSDP2), for models too big for one GPU. LoRA and embedding "
                                "runs always use ddp (fsdp only warns).", choices=["ddp", "fsdp"])
    fsdp_sharding_strategy: str = f("full_shard", "FSDP: full_shard frees each block's gathered weights after its "
                                                  "forward (least memory); shard_grad_op keeps them for the backward "
                                                  "(faster, more memory). FSDP2's reshard_after_forward true/false.",
                                    choices=["full_shard", "shard_grad_op"])
    fsdp_offload_params: bool = f(False, "FSDP: keep the sharded weights, gradients and optimizer state in CPU RAM "
                                         "(far less GPU memory, slower). GPUs only.")
    fsdp_auto_wrap_policy: str = f("transformer_based_wrap", "FSDP: the blocks gathered one at a time: the classes "
                                                             "in fsdp_transformer_layer_cls_to_wrap, every block "
                                                             "over fsdp_min_num_params, or no_wrap (the whole UNet "
                                                             "at once: no memory saved while it runs).",
                                   choices=["transformer_based_wrap", "size_based_wrap", "no_wrap"])
    fsdp_transformer_layer_cls_to_wrap: str = f("", "FSDP transformer_based_wrap: block classes, comma-separated "
                                                    "(e.g. BasicTransformerBlock,ResnetBlock2D); empty = the UNet's "
                                                    "own list (its _no_split_modules).")
    fsdp_min_num_params: int = f(100_000_000, "FSDP size_based_wrap: blocks with more parameters than this are "
                                              "gathered as one unit.", min=0, max=10**12)
    accelerate_config: str = f("", "An accelerate config file (from `accelerate config`) passed to accelerate launch "
                                    "as --config_file; when it sets distributed_type: FSDP, full fine-tunes use fsdp "
                                    "with its fsdp_config settings.", ui="path")


@dataclass
class ModelConfig:
    path: str = f("", "Base model: a diffusers folder, a hub id (org/name), a .safetensors/.ckpt file, "
                      "or builtin:tiny-sd / builtin:tiny-sd2 / builtin:tiny-sdxl for offline demo models.",
                  ui="path")
    family: str = f("auto", "Model family; auto detects it from the weights. An inpainting model takes its "
                            "base family; inpainting is detected from the UNet's 9 input channels.",
                    choices=family_choices())
    prediction_type: str = f("auto", "What the UNet predicts; auto reads it from the model "
                                     "(SD 2.x 768 models are v_prediction).",
                             choices=["auto", "epsilon", "v_prediction"])
    config_path: str = f("", "For single-file models: a diffusers folder whose configs describe the model; "
                             "empty = the built-in config of the detected family.", ui="path")
    training_adapter: str = f("", "A LoRA added to the frozen base while training and left out of the saved LoRA: "
                                  "a distilled model's de-distilling adapter (Z-Image Turbo: ostris/zimage_turbo_"
                                  "training_adapter/zimage_turbo_training_adapter_v2.safetensors), so the LoRA learns "
                                  "the concept, not to undo the distillation. A .safetensors file or a hub file "
                                  "(org/repo/file.safetensors) in the family's LoRA layout; samples are drawn "
                                  "without it. Empty = none.", ui="path")
    effnet_path: str = f("", "Stable Cascade / Würstchen 2: the EfficientNet image encoder the prior was trained "
                             "against (Cascade: effnet_encoder.safetensors of stabilityai/stable-cascade; Würstchen 2: "
                             "model_v2_stage_b.pt of dome272/wuerstchen). Empty = effnet_encoder.safetensors in the "
                             "model folder, else (Cascade) the official file from the hub.", ui="path")
    decoder_path: str = f("", "Stable Cascade / Würstchen 2: the decoder stages that turn the prior's output into "
                              "sample images (a diffusers decoder pipeline folder or hub id). Empty = the model "
                              "folder itself when it holds the decoder, else the official decoder.", ui="path")
    cascade_variant: str = f("full", "Stable Cascade from a hub id or diffusers folder: the full 3.6B prior "
                                     "(prior/) or the 1B lite one (prior_lite/); samples use the matching "
                                     "decoder (decoder/ or decoder_lite/).", choices=["full", "lite"])
    hub_offline: bool = f(False, "Never touch the network: a hub id must already be in the cache.")
    cache_dir: str = f("", "Hub cache folder; empty = the Hugging Face default.", ui="path")
    revision: str = f("", "Hub revision (branch, tag or commit); empty = main.")
    vae_dtype: str = f("fp32", "VAE dtype (fp32 avoids NaN latents with the SD VAE).", choices=DTYPES)
    clip_skip: int = f(0, "Skip the last N text-encoder layers (SD 1.x anime models use 1; for SDXL, layers "
                          "beyond its default penultimate one).", min=0, max=12)
    attention: str = f("sdpa", "Attention backend: PyTorch SDPA, or xformers when installed.",
                       choices=["sdpa", "xformers"])
    wan_expert: str = f("low", "Wan 2.2 A14B (two experts split at the pipeline's boundary, σ 0.875 for "
                               "text-to-video, 0.9 for image-to-video): which expert trains, each on its own noise range — high (σ ≥ the boundary: layout "
                               "and motion), low (below it: detail) or both (each sample trains the expert of its "
                               "σ; the result is two files, the low expert's named …_low_noise). A LoRA file is for "
                               "one expert (ComfyUI: apply it to that expert's model; diffusers: the low expert's with "
                               "load_into_transformer_2=True). Other models ignore it.",
                        choices=["high", "low", "both"])
    system_prompt: str = f("", "Lumina 2 / Neta-Lumina: the system prompt put before every caption and sample prompt "
                               "(joined with \" <Prompt Start> \", as Lumina2Pipeline does). Empty = the pipeline's own; "
                               "Neta-Lumina's card and kohya's trainer name their own. Changing it re-encodes the "
                               "cached captions. Other models ignore it.")
    guidance_scale: float = f(3.5, "Guidance-distilled models (Flux.1 dev, FLUX.1 Kontext [dev], Flux.2 [dev]): the "
                                    "guidance their transformer's guidance embedding gets while training, as "
                                    "diffusers' and kohya's trainers feed it (3.5; OneTrainer, ai-toolkit and musubi "
                                    "use 1). Models without a guidance embedding ignore it.", min=0.0, max=20.0)
    inpainting_mask: str = f("random", "Inpainting models (9-channel UNet): where the repaint masks come from — "
                                       "random rectangles/brush strokes, each image's own mask (data.masks), or "
                                       "both (a coin per image).", choices=["random", "data", "both"])
    inpainting_full_mask: float = f(0.25, "Inpainting models, random masks: fraction of images masked whole "
                                          "(keeps text-only generation working).", min=0.0, max=1.0)


@dataclass
class ConceptConfig:
    name: str = f("", "A label for this concept in reports and logs.")
    path: str = f("", "Folder of training images.", ui="path")
    enabled: bool = f(True, "Train on this concept.")
    recursive: bool = f(False, "Also read images in sub-folders.")
    caption_source: str = f("txt", "Where captions come from: <image>.txt, one text file for all, "
                                   "or the file name.",
                            choices=["txt", "concept_file", "filename"])
    caption_file: str = f("", "With caption_source=concept_file: the text file (one caption a line).",
                          ui="path")
    caption_extension: str = f(".txt", "Extension of per-image caption files.")
    repeats: float = f(1.0, "How many times each image is seen per epoch.", min=0.0, max=10000.0)
    samples: int = f(0, "Samples per epoch from this concept, spread over its images (balances concepts "
                        "of different sizes); 0 = use repeats.", min=0, max=10**7)
    loss_weight: float = f(1.0, "Loss multiplier for this concept.", min=0.0, max=100.0)
    resolution: str = f("", "This concept's own training resolution (like data.resolution); empty = "
                            "data.resolution.")
    role: str = f("train", "What the concept's images are for: train; validation (never trained on, its loss is "
                           "measured and logged); regularisation (class images beside a subject, trained with "
                           "loss_weight as the prior-preservation weight, so the subject does not bleed into its "
                           "class); prior_prediction (LoRA: the target is the base model's own prediction on the "
                           "image, adapter off, keeping what the model already does there).",
                  choices=["train", "validation", "regularisation", "prior_prediction"])
    control_paths: List[str] = f(help="Folders of control (edit source) or reference images, one folder per image "
                                      "the model takes, in its order: each image of the concept pairs with the "
                                      "file of the same name (any image extension) in every folder. Edit models "
                                      "(FLUX.1 Kontext, Qwen-Image-Edit) and Flux.2 references.", factory=list, ui="paths")
    shuffle_tags: bool = f(False, "Shuffle the caption's tags (split at tag_delimiter) every time.")
    tag_delimiter: str = f(",", "What separates tags in a caption.")
    keep_tags: int = f(0, "Keep the first N tags in place (never shuffled or dropped), e.g. the trigger word.",
                       min=0, max=1000)
    tag_dropout: float = f(0.0, "Probability of leaving out each tag (not the kept ones).", min=0.0, max=1.0)
    tag_dropout_keep: str = f("", "Tags never dropped, separated by tag_delimiter.")
    caption_dropout: float = f(0.0, "Probability of training an image with an empty caption "
                                    "(helps classifier-free guidance).", min=0.0, max=1.0)
    # clips (video families; musubi-tuner's dataset names). Frames are counted at the model's frame rate.
    target_frames: str = f("33", "Video families: frame counts to take from each clip, one or a comma list (17,33); "
                                 "each a count the VAE takes (4k+1 for Wan: 1, 5, 9 … 81). A clip shorter than the "
                                 "smallest is skipped. Images train as one frame.")
    frame_extraction: str = f("head", "Video families: which windows of a clip train: head (its first frames), chunk "
                                      "(back-to-back windows), slide (a window every frame_stride frames), uniform "
                                      "(frame_sample windows evenly spaced), full (the whole clip up to max_frames, "
                                      "rounded down to a count the VAE takes).",
                              choices=["head", "chunk", "slide", "uniform", "full"])
    frame_stride: int = f(1, "Video families, frame_extraction slide: frames between window starts.", min=1,
                          max=100000)
    frame_sample: int = f(1, "Video families, frame_extraction uniform: how many windows per clip.", min=1, max=10000)
    max_frames: int = f(0, "Video families, frame_extraction full: the longest window; 0 = the model's longest "
                           "(81 for Wan).", min=0, max=100000)


@dataclass
class DataConfig:
    concepts: List[ConceptConfig] = f(help="Image folders to train on.", factory=list)
    resolution: str = f("512", "Training resolution: 512, WxH (768x512), or a comma list (384,448,512) of "
                               "which each step trains on one at random; a pixel budget for the aspect buckets.")
    aspect_buckets: bool = f(True, "Train each image at the bucket nearest its aspect ratio (same pixel count); "
                                   "off = crop every image to the resolution's shape.")
    bucket_step: int = f(64, "Bucket sides are multiples of this (64 for SD 1.x/2.x).", min=8, max=512)
    max_aspect_ratio: float = f(2.0, "Most elongated bucket (long side / short side).", min=1.0, max=8.0)
    max_upscale: float = f(2.0, "Enlarge an image at most this much to fill its bucket; a smaller image trains "
                                "at a smaller bucket instead. 0 = no limit.", min=0.0, max=64.0)
    center_crop: bool = f(True, "Crop the center after resizing (off = random crop).")
    random_flip: bool = f(False, "Flip images horizontally at random.")
    rotation: float = f(0.0, "Rotate by up to this many degrees (0 = off).", min=0.0, max=180.0)
    crop_jitter: float = f(0.0, "Zoom in by up to this fraction at a random position (0 = off).",
                           min=0.0, max=0.5)
    brightness: float = f(0.0, "Change brightness by up to ± this fraction (0 = off).", min=0.0, max=1.0)
    contrast: float = f(0.0, "Change contrast by up to ± this fraction (0 = off).", min=0.0, max=1.0)
    saturation: float = f(0.0, "Change saturation by up to ± this fraction (0 = off).", min=0.0, max=1.0)
    hue: float = f(0.0, "Shift hue by up to ± this fraction of the colour circle (0 = off).", min=0.0, max=0.5)
    augment_random: bool = f(True, "Draw each augmentation at random up to its strength; off = apply "
                                   "exactly the strength to every image.")
    augment_variants: int = f(0, "With latent caching and augmentations: cache this many augmented versions "
                                 "per image; 0 = augmented images skip the cache (encoded every step).",
                              min=0, max=256)
    masks: bool = f(False, "Masked training: read <image>-masklabel.png (white = focus) next to each image.")
    variable_frame_rate: str = f("resample", "Video families: a clip whose frame rate varies (phone recordings, "
                                             "GIFs) is resampled to the model's rate by its frames' timestamps, "
                                             "or skipped (and listed in the dataset report).",
                                 choices=["resample", "skip"])
    control_resolution: str = f("", "Control and reference images: a pixel budget (1024, or WxH) they are resized to, "
                                    "with their target's aspect ratio; empty = the target's own bucket size (the same "
                                    "crop and flip as the target either way).")
    cache_latents: bool = f(True, "Encode images with the VAE once and reuse the latents.")
    cache_text: bool = f(True, "Cache text-encoder outputs when the text encoder is frozen and captions have "
                               "no tag shuffling or tag dropout.")
    offload_text_encoders: bool = f(False, "With the text cache on and every text encoder frozen: the text encoders "
                                           "leave the GPU once the captions are cached, and come back only to "
                                           "encode sample prompts (leaving again before the denoiser runs). Saves "
                                           "their size in VRAM (T5-XXL: ~9 GB in bf16) for a few seconds per sample.")
    cache_dir: str = f("", "Where caches live; empty = <workspace>/cache.", ui="path")
    only_cache: bool = f(False, "Fill the caches, then stop without training.")


@dataclass
class SamplePromptConfig:
    prompt: str = f("", "Text of the sample.", ui="textarea")
    negative_prompt: str = f("", "Negative prompt.")
    seed: int = f(42, "Seed of the sample's noise.", min=0, max=2**32 - 1)
    steps: Optional[int] = f(None, "Denoising steps; empty = the model's own default (e.g. 28 for Flux.1 [dev], 4 for "
                                   "[schnell], 20 for SD; docs/families.md lists them).", min=1, max=1000)
    cfg_scale: Optional[float] = f(None, "Guidance scale: classifier-free guidance, Flux's embedded guidance, or "
                                         "Qwen-Image's true CFG; empty = the model's own default (e.g. 7 for SD, 3.5 "
                                         "for Flux.1 [dev], 0 for Z-Image Turbo; docs/families.md lists them).",
                                   min=0.0, max=50.0)
    width: int = f(512, "Width in pixels (multiple of 8).", min=64, max=4096)
    height: int = f(512, "Height in pixels (multiple of 8).", min=64, max=4096)
    image: str = f("", "Inpainting models: the image to repaint (resized to width × height); empty = a "
                       "blank image. Image-to-video models (Wan I2V): the start frame (required).", ui="path")
    mask: str = f("", "Inpainting models: the mask (white = repaint); empty = repaint everything.", ui="path")
    control_images: List[str] = f(help="Edit and reference models: the image(s) the sample edits or refers to, one "
                                       "per control folder of the concepts, in the same order.", factory=list,
                                  ui="paths")


@dataclass
class SamplingConfig:
    every_n_steps: int = f(0, "Sample every N optimizer steps; 0 = never.", min=0, max=10**7)
    every_n_epochs: int = f(1, "Sample every N epochs; 0 = never.", min=0, max=100000)
    at_start: bool = f(False, "Sample once before training (a baseline).")
    at_end: bool = f(True, "Sample once after the last step.")
    scheduler: str = f("auto", "Sampler of SD, SDXL and PixArt (the other families always sample with their own); "
                               "auto = the model's own default (DDIM for SD and SDXL, DPM-Solver for PixArt).",
                       choices=["auto", "ddim", "euler", "euler_a", "dpmpp_2m"])
    frames: int = f(0, "Video models (Wan): frames of each sample video (the VAE takes 4k+1: 1, 5, 9 … 81); "
                       "0 = the model's own default (81 for Wan). Image models draw one frame.", min=0, max=1001)
    prompts: List[SamplePromptConfig] = f(help="Prompts sampled during training.", factory=list)


@dataclass
class BackupConfig:
    every_n_steps: int = f(0, "Write a backup every N optimizer steps; 0 = never.", min=0, max=10**7)
    every_n_epochs: int = f(0, "Write a backup every N epochs; 0 = never.", min=0, max=100000)
    keep_last: int = f(2, "Keep the newest K backups; older ones are deleted.", min=1, max=1000)
    on_stop: bool = f(True, "Write a backup when the run is stopped (Stop / Ctrl+C).")


@dataclass
class OutputConfig:
    name: str = f("", "File or folder name of the result; empty = the run name.")
    path: str = f("", "Folder for the result; empty = the run folder.", ui="path")
    format: str = f("auto", "Result format: auto = kohya .safetensors for LoRA, single file for "
                            "fine-tunes.",
                    choices=["auto", "safetensors", "diffusers", "ckpt"])
    dtype: str = f("fp16", "dtype of the saved weights.", choices=DTYPES)
    save_every_n_epochs: int = f(0, "Also save an intermediate result every N epochs; 0 = only at the end.",
                                 min=0, max=100000)
    dora_format: str = f("comfyui", "DoRA results: which loader's formula the file is written for (each loader "
                                    "reads dora_scale differently; the file is exact in the one picked). comfyui = "
                                    "ComfyUI and Forge; a1111 = AUTOMATIC1111 v1.10 (and ComfyUI/Forge builds from "
                                    "before 2025; a larger file); lycoris = the LyCORIS/kohya formula (OneTrainer, "
                                    "sd-scripts, LyCORIS). diffusers applies no DoRA file exactly (it drops "
                                    "dora_scale).",
                         choices=["comfyui", "a1111", "lycoris"])
    config_metadata: str = f("portable", "The training config written into the result's metadata: portable "
                                         "(paths relative to the workspace; folders outside it by their name "
                                         "only), full (as run, absolute paths included) or none.",
                             choices=["portable", "full", "none"])


@dataclass
class DenoiserPart:
    train: bool = f(True, "Train the denoiser (the UNet, or the transformer of PixArt/Flux).")
    learning_rate: Optional[float] = f(None, "Learning rate of the denoiser; blank = training.learning_rate.",
                                       min=0.0, max=10.0)
    stop_after_steps: int = f(0, "Stop training the denoiser after this many optimizer steps; 0 = never.",
                              min=0, max=10**8)
    stop_after_epochs: int = f(0, "Stop training the denoiser after this many epochs; 0 = never.", min=0, max=100000)
    dtype: str = f("fp32", "Storage dtype of the denoiser's weights (frozen ones for a LoRA).", choices=DTYPES)
    fp8: bool = f(False, "Store the frozen denoiser weights in fp8 (e4m3) and upcast each layer as it runs: about "
                         "half the memory of fp16. LoRA only.")
    fp8_matmul: bool = f(False, "With fp8 storage: the frozen Linear layers multiply on the GPU's fp8 tensor cores "
                                "(twice their bf16 rate; inputs rounded to fp8 per tensor, fp32 sums, gradients as "
                                "before). RTX 40xx, L4/L40, H100/H200 and newer (compute capability 8.9+); the "
                                "inputs' rounding fuses best with training.compile. Needs parts.denoiser.fp8.")
    fp8_scaled: bool = f(False, "With fp8 storage: each layer's weights are divided by a scale per output row "
                                "(its largest magnitude maps to fp8's largest, 448) before they are rounded, and "
                                "multiplied back as the layer runs, as musubi-tuner's --fp8_scaled: small weights keep "
                                "fp8's precision instead of falling among its subnormals. Needs parts.denoiser.fp8.")
    fp8_scale_block: int = f(0, "With fp8_scaled: 0 = one scale per output row; N = one scale per block of N inputs "
                                "in each row, musubi-tuner's default --fp8_scaled (64): a few large weights then cost "
                                "only their block's precision (one fp32 more per N weights: 6 % more memory at 64). "
                                "A power of two from 16 to 4096; not with fp8_matmul.", min=0, max=4096)
    nf4: bool = f(False, "Store the frozen denoiser's Linear weights in 4-bit NF4 (bitsandbytes, as QLoRA) and "
                         "dequantize each layer as it runs: about a quarter of the memory of bf16 for a transformer. "
                         "LoRA (lora.type = lora) only; not with fp8.")
    blocks_to_swap: int = f(0, "Keep the frozen weights of the denoiser's first N transformer blocks in CPU RAM and "
                               "bring them to the GPU one block at a time as they run (as kohya/musubi's "
                               "blocks_to_swap): less VRAM, slower steps. Transformer families only; needs "
                               "training.gradient_checkpointing. 0 = off.", min=0, max=1000)
    lora_blocks: str = f("", "Only these blocks of the denoiser get adapters: block numbers and ranges (0-7,12) of "
                             "each of its block lists, or of one list (single_transformer_blocks:10-37); the lists "
                             "are transformer_blocks, single_transformer_blocks, down_blocks, layers … as the model "
                             "names them. Empty = every block.")
    lora_targets: str = f("attn", "Denoiser layers a LoRA adapts: attention, attention+MLP, all (adds conv layers: "
                                  "LoCon), or custom (lora.custom_targets).",
                          choices=["attn", "attn_mlp", "all", "custom"])


@dataclass
class TextEncoderPart:
    enabled: bool = f(True, "Condition on this encoder. Off: it sees only the empty caption, in training and in "
                            "samples (Flux: T5 off, CLIP-L alone; captions must then fit CLIP's 77 tokens). Only "
                            "for encoders a family can do without.")
    train: bool = f(False, "Train this text encoder.")
    learning_rate: Optional[float] = f(None, "Learning rate of this text encoder; blank = training.learning_rate.",
                                       min=0.0, max=10.0)
    stop_after_steps: int = f(0, "Train this text encoder only for the first N optimizer steps (then it is "
                                 "frozen); 0 = the whole run.", min=0, max=10**8)
    stop_after_epochs: int = f(0, "Train this text encoder only for the first N epochs; 0 = the whole run.",
                               min=0, max=100000)
    dtype: str = f("fp32", "Storage dtype of this text encoder's weights.", choices=DTYPES)
    fp8: bool = f(False, "Store this frozen text encoder's Linear weights in fp8 (e4m3) and upcast each layer as it "
                         "runs: half the memory of bf16 (Mistral Small 3.1 of Flux.2 [dev]: 22 instead of 45 GiB). Its "
                         "outputs shift a little (the text cache keeps them). Not with train.")
    fp8_scaled: bool = f(False, "With fp8: each layer's weights divided by a scale per output row before they are "
                                "rounded (the row's largest magnitude maps to fp8's largest) and multiplied back as it "
                                "runs, as ComfyUI's scaled fp8 text encoders: its outputs shift less. Needs fp8.")
    fp8_scale_block: int = f(0, "With fp8_scaled: 0 = one scale per output row; N = one scale per block of N inputs "
                                "in each row (a power of two from 16 to 4096; musubi-tuner's default is 64).",
                             min=0, max=4096)
    nf4: bool = f(False, "Store this frozen text encoder's Linear weights in 4-bit NF4 (bitsandbytes) and dequantize "
                         "each layer as it runs: a quarter of bf16 (Mistral Small 3.1: ~12 GiB). Its outputs shift more "
                         "than with fp8. Not with train or fp8.")
    caption_dropout: float = f(0.0, "Per-encoder caption dropout: probability that this encoder's output for an "
                                    "image is dropped (zeroed, its unconditional input; SD 1.x/2.x: the empty "
                                    "caption). SDXL's second encoder drops its pooled embedding too.",
                               min=0.0, max=1.0)


@dataclass
class PartsConfig:
    denoiser: DenoiserPart = f(help="The denoiser: UNet (SD, SDXL) or transformer (PixArt, Flux).",
                               factory=DenoiserPart)
    text_encoder_1: TextEncoderPart = f(help="The first text encoder: CLIP-L (SD, SDXL, Flux), T5 (PixArt).",
                                        factory=TextEncoderPart)
    text_encoder_2: TextEncoderPart = f(help="The second text encoder: OpenCLIP-G (SDXL), T5-XXL (Flux).",
                                        factory=TextEncoderPart)
    text_encoder_3: TextEncoderPart = f(help="The third text encoder (families with three).", factory=TextEncoderPart)
    text_encoder_4: TextEncoderPart = f(help="The fourth text encoder (HiDream-I1's Llama 3.1).",
                                        factory=TextEncoderPart)


@dataclass
class AtelierConfig:
    version: int = f(CONFIG_VERSION, "Config format version (for migrating old files).",
                     min=1, max=CONFIG_VERSION, ui="hidden")
    general: GeneralConfig = f(help="Workspace, run name, seed, device.", factory=GeneralConfig)
    model: ModelConfig = f(help="Base model and precision.", factory=ModelConfig)
    data: DataConfig = f(help="Concepts and image handling.", factory=DataConfig)
    parts: PartsConfig = f(help="Per-part settings of the model (denoiser, text encoders): train on/off, learning "
                                "rate, training window, dtype, caption dropout, LoRA targets.", factory=PartsConfig)
    training: TrainingConfig = f(help="Optimisation.", factory=TrainingConfig)
    loss: LossConfig = f(help="Loss function and weighting.", factory=LossConfig)
    ema: EmaConfig = f(help="Exponential moving average of the weights.", factory=EmaConfig)
    precision: PrecisionConfig = f(help="fp8 weight storage and bf16 stochastic rounding.",
                                   factory=PrecisionConfig)
    lora: LoraConfig = f(help="LoRA adapter (training.method = lora).", factory=LoraConfig)
    embedding: EmbeddingConfig = f(help="Textual-inversion embedding (training.method = embedding, or "
                                        "embedding.train_alongside).", factory=EmbeddingConfig)
    sampling: SamplingConfig = f(help="Sample images during training.", factory=SamplingConfig)
    backup: BackupConfig = f(help="Backups for resuming.", factory=BackupConfig)
    output: OutputConfig = f(help="The saved result.", factory=OutputConfig)
