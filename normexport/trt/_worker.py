"""Child process of builder.build(): `python -m normexport.trt._worker SPEC.json RESULT.json`."""

import json
import sys

from .builder import BuildError, BuildSpec, build_in_process


def main(spec_path: str, result_path: str) -> int:
    with open(spec_path) as f:
        spec = BuildSpec(**json.load(f))
    try:
        result = build_in_process(spec).to_dict()
        result.pop("plugin_layer_count"), result.pop("bodies")
        code = 0
    except BuildError as e:
        result, code = {"error": str(e)}, 1
    with open(result_path, "w") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
