"""The model catalog and the bundled tiny pair with its prompts, installed as package data of dflash_local.models."""
