"""Model sources by URI (hf://, s3://, pvc://, file://): parsing, downloads with progress,
the shared model cache, and `kvpilot fetch-model`."""
