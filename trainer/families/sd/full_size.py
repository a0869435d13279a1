"""Full-size configs of the SD lineage's models: the SD kit's shipped diffusers configs (see
:mod:`trainer.families.common.full_size`)."""

from trainer.families.common.sd_kit.sd_configs import full_size_folder as config_folder  # noqa: F401
