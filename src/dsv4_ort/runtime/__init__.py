"""Runtime: load an exported model with the custom-op library, keep per-sequence state in place, generate.

No torch here: onnxruntime + numpy (and ``tokenizers`` for text, when the model has a tokenizer.json).
"""

from .sampling import sample
from .session import ModelError, Session, physical_cores, read_metadata
from .state import State

__all__ = ["Session", "State", "ModelError", "sample", "physical_cores", "read_metadata"]
