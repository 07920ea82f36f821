{{- define "kvpilot.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}{{ .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "kvpilot.selectorLabels" -}}
app.kubernetes.io/name: kvpilot-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvpilot.labels" -}}
{{ include "kvpilot.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvpilot
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvpilot.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "kvpilot.fullname" .) .Values.serviceAccount.name }}
{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{/* The operator's permissions: exactly what kvpilot/operator uses, no wildcards. */}}
{{- define "kvpilot.rules" -}}
- apiGroups: ["serving.kvpilot.dev"]
  resources: ["llmdeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["serving.kvpilot.dev"]
  resources: ["llmdeployments/status"]
  verbs: ["get", "patch"]
# The autotuner moves replicas as an HPA would, through the scale subresource ...
- apiGroups: ["serving.kvpilot.dev"]
  resources: ["llmdeployments/scale"]
  verbs: ["patch"]
# ... and leaves them alone when an HPA targets the LLMDeployment.
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["list"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["configmaps", "services"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims", "secrets"]
  verbs: ["get"]
# Why engine pods are not ready (a crash loop's exit code and message) for Degraded.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]
# A model download's progress: the last line of the model-fetch init container's log.
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
