"""The serving app: ONNX Runtime over the production model, Prometheus metrics, drift."""
