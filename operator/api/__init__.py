"""The LLMDeployment API: pydantic spec and status models, conditions, and the CRD generated
from them."""
