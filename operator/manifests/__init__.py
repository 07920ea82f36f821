"""Pure `build_*` functions that return manifests: the engine Deployment and Service, the
tuning ConfigMap, model downloads, dashboards, multi-GPU and simulated pods."""
