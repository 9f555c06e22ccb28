from .loop import TrainConfig, train

__all__ = ["TrainConfig", "train"]
