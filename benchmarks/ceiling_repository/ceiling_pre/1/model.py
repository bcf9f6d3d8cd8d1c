"""The platform ceiling's step before the stream: ``text_input`` → ``input_ids`` (its UTF-8
bytes as ids), one request at a time as the ``tokenizer`` model takes them."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
            ids = np.frombuffer(bytes(text.reshape(-1)[0]), dtype=np.uint8).astype(np.int32)
            tensor = pb_utils.Tensor("input_ids", ids)
            responses.append(pb_utils.InferenceResponse(output_tensors=[tensor]))
        return responses
