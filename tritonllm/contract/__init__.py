"""The contract between the sidecar, the Triton models and the engine, declared once.

``tensors``: every model's and the ensembles' input/output names, datatypes, shapes and
optional flags (a test holds ``model_repository/*/config.pbtxt`` to them). ``limits``: every
request limit (n, logprobs, stop strings, sampling ranges) and the logprob floor on the wire.
``errors``: the error codes, the ``RequestError`` the engine and the models raise, and the one
wire form in which an error crosses from a Triton model to a client. Pure Python: importable
without torch or numpy.
"""

from tritonllm.contract import errors, limits, tensors

__all__ = ["errors", "limits", "tensors"]
