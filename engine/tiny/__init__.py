"""The built-in tiny model: `kvpilot make-tiny-model`, its tokenizer and optional training."""
