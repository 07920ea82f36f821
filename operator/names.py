"""The names users' tools, the operator and the gateway share: the LLMDeployment API's group,
version and kind, and the labels and port of the engine pods it runs. A public contract, so the
gateway (which imports nothing else of the operator) reads them from here."""

GROUP = "serving.kvpilot.dev"
VERSION = "v1alpha1"
KIND = "LLMDeployment"
PLURAL = "llmdeployments"
SINGULAR = "llmdeployment"
SHORT_NAMES = ["llmd"]

INSTANCE_LABEL = f"{GROUP}/llmdeployment"  # on every object the operator owns: the LLMDeployment's name
ENGINE_APP_NAME = "kvpilot-engine"  # app.kubernetes.io/name of engine pods
ENGINE_POD_SELECTOR = f"app.kubernetes.io/name={ENGINE_APP_NAME}"
HTTP_PORT = 8000  # the engine's OpenAI port, named "http" on its container
