"""kvpilot's Kubernetes operator: the LLMDeployment API (pydantic models that
generate the CRD), pure manifest builders, the apply layer and kopf handlers.

Nothing heavy is imported here: `kvpilot.operator.cli` must load without kopf."""
