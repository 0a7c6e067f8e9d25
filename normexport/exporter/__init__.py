"""normexport.exporter: torch.onnx's exporters as the ladder of docs/design.md §9.

    rungs   one export (dynamo or TorchScript-based), fixed, with the normexport functions, validated
    ladder  the rungs in order, each file handed to the caller's judge; the first accepted is kept

`normexport.export.convert_module_ir` (the API) and `normexport convert`'s export stage both run
the ladder; they differ only in the judge they give it.
"""
