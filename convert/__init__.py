"""loopspec.convert: staged conversion to deployable artifacts (ONNX, TensorRT, serving bundles)."""
