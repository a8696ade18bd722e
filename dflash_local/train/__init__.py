"""`dflash train`: self-distillation from the target, the DFlash block objective and the training loop."""
