"""Generic file writers and readers (kohya/ComfyUI LoRA, LyCORIS, DoRA per loader, embeddings, checkpoints,
diffusers folders, header metadata). Each takes the family's namer and metadata instead of knowing a family; the
family-specific key maps live with the families (e.g. the SD kit's ``keys``). Import each module by its full name."""
