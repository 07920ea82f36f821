"""The engine's configuration, defined once: engine settings (EngineConfig), the command-line
flags generated from them, model configs, quantities, speculative and simulation settings,
and their validation."""
