"""The platform ceiling's step after the stream, shaped like ``detokenizer``: per request,
``text_output`` (the new ids written out, instead of detokenized) and
``logprobs_json`` ``""``; ``finish_reason`` and the counts pass through; ``index`` is 0."""

import numpy as np
import triton_python_backend_utils as pb_utils

PASS_THROUGH = ("finish_reason", "num_output_tokens")
OPTIONAL = ("num_input_tokens", "cached_tokens")  # first and last responses only


class TritonPythonModel:
    def _response(self, request):
        def array(name):
            return pb_utils.get_input_tensor_by_name(request, name).as_numpy()

        passed = {name: array(name) for name in PASS_THROUGH}
        new_ids = array("output_ids").reshape(-1).tolist()
        array("prefix_ids").reshape(-1).tolist()  # read as the detokenizer reads its context
        for name in OPTIONAL:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                passed[name] = tensor.as_numpy()
        trim_tensor = pb_utils.get_input_tensor_by_name(request, "trim_chars")
        trim = 0 if trim_tensor is None else int(trim_tensor.as_numpy().reshape(-1)[0])
        text = " ".join(str(i) for i in new_ids)
        text = text[: len(text) - trim] if trim else text
        batch_shape = passed["finish_reason"].shape  # [1] (no batch dimension)
        passed["index"] = np.zeros(batch_shape, np.int32)
        strings = {"text_output": text, "logprobs_json": ""}
        outputs = [
            pb_utils.Tensor(name, np.array([v.encode()], np.object_).reshape(batch_shape))
            for name, v in strings.items()
        ]
        outputs += [pb_utils.Tensor(name, value) for name, value in passed.items()]
        return pb_utils.InferenceResponse(output_tensors=outputs)

    def execute(self, requests):
        return [self._response(request) for request in requests]
