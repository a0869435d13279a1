"""The configuration: ``schema`` and ``schema_training`` (the one schema, torch-free; ``declare.f`` declares a
field), ``fields`` (reading it: keys, types, allowed values), ``load`` (preset ⊕ file ⊕ ``--set``, migration; no
checks), ``checks`` (the field checks and every area's rules; ``load_config``/``config_from_dict`` compose and
validate) and ``preflight`` (files and folders a run would reject). Nothing is imported here: import each module
by its name."""
