"""ensemble_unary: preprocessing -> encoders -> inkling (model_repo/pipeline.py)."""

from model_repo.pipeline import PipelineModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
