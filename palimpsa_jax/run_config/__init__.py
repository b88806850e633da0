"""The run-config schema (base.py: every field the trainer reads) and the `key=value`
arguments (config_args.py) that the config files in the top-level configs/ are built from."""
