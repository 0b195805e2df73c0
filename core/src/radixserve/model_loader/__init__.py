from radixserve.model_loader.loader import LoadedCheckpoint, default_model_path, load_checkpoint

__all__ = ["LoadedCheckpoint", "default_model_path", "load_checkpoint"]
