"""Qwen-Image: an MMDiT over a Qwen2.5-VL text model's features and a Wan-style VAE; and its edit models
(Qwen-Image-Edit, -2509, -2511), which read control images beside the instruction.

Modules: ``info`` (registry entry), ``detect`` (which variant a folder or file is), ``family`` (text to image),
``edit`` (the edit models, and the loader that picks the class), ``vl`` (what Qwen2.5-VL sees of the control images,
and the processor built without torchvision), ``keys``, ``tiny``, ``full_size``."""
