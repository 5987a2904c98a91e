"""Checkpoint machinery below the strategies: state dictionaries, sharded directories, safe loading."""
