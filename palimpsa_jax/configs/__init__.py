"""What configs/*.py are built from: their `key=value` arguments and the run config's fields."""
