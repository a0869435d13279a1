"""HunyuanImage 2.1: its family folder."""
