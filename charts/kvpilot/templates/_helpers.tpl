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

{{/* The gateway (`kvpilot gateway`): its own name, labels and service account. The
     name label is the one networkPolicy.clients admits by default. */}}
{{- define "kvpilot.gateway.fullname" -}}
{{ include "kvpilot.fullname" . | trunc 55 | trimSuffix "-" }}-gateway
{{- end -}}

{{- define "kvpilot.gateway.selectorLabels" -}}
app.kubernetes.io/name: kvpilot-gateway
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: gateway
{{- end -}}

{{- define "kvpilot.gateway.labels" -}}
{{ include "kvpilot.gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kvpilot
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kvpilot.gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create -}}{{ default (include "kvpilot.gateway.fullname" .) .Values.gateway.serviceAccount.name }}
{{- else -}}{{ default "default" .Values.gateway.serviceAccount.name }}{{- end -}}
{{- end -}}

{{/* The gateway's permissions: it only reads the routing table (LLMDeployments and their
     engine pods); it never writes to the API. */}}
{{- define "kvpilot.gateway.rules" -}}
- apiGroups: ["serving.kvpilot.dev"]
  resources: ["llmdeployments"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# scale from zero: spec.replicas 0 -> 1 for a held request, and nothing else
- apiGroups: ["serving.kvpilot.dev"]
  resources: ["llmdeployments/scale"]
  verbs: ["get", "patch"]
{{- end -}}

{{/* Where the pod mounts tenant keys: /etc/kvpilot/gateway/keys/<tenant>/<key>. */}}
{{- define "kvpilot.gateway.keysDir" -}}/etc/kvpilot/gateway/keys{{- end -}}

{{/* The gateway's tenants file (operator/gateway/tenants.py reads it), from gateway.tenants:
     each tenant's API key is the file its Secret's key is mounted as. */}}
{{- define "kvpilot.gateway.tenantsFile" -}}
{{- $names := list }}
{{- $tenants := list }}
{{- range .Values.gateway.tenants }}
{{- if has .name $names }}
{{- fail (printf "gateway.tenants: the name %q is used twice" .name) }}
{{- end }}
{{- $names = append $names .name }}
{{- $key := .apiKeySecret.key | default "api-key" }}
{{- $t := dict "name" .name "apiKeyFiles" (list (printf "%s/%s/%s" (include "kvpilot.gateway.keysDir" $) .name $key)) }}
{{- with .models }}{{ $_ := set $t "models" . }}{{ end }}
{{- with .requestsPerWindow }}{{ $_ := set $t "requestsPerWindow" (int64 .) }}{{ end }}
{{- with .tokensPerWindow }}{{ $_ := set $t "tokensPerWindow" (int64 .) }}{{ end }}
{{- if hasKey . "priority" }}{{ $_ := set $t "priority" (int64 .priority) }}{{ end }}
{{- $tenants = append $tenants $t }}
{{- end }}
{{- toYaml (dict "window" .Values.gateway.rateLimitWindow "tenants" $tenants) }}
{{- end -}}

{{- /* The engine pods' defaults, as `kvpilot operator --engine-defaults` reads them (JSON). */ -}}
{{- define "kvpilot.engineDefaults" -}}
{{- $e := .Values.engine -}}
{{- $pod := dict "imagePullSecrets" (default (list) $e.imagePullSecrets) "annotations" (default (dict) $e.podAnnotations) "labels" (default (dict) $e.podLabels) -}}
{{- with $e.serviceAccountName }}{{ $_ := set $pod "serviceAccountName" . }}{{ end -}}
{{- with $e.securityContext }}{{ $_ := set $pod "securityContext" . }}{{ end -}}
{{- $sched := dict "nodeSelector" (default (dict) $e.nodeSelector) "tolerations" (default (list) $e.tolerations) -}}
{{- with $e.affinity }}{{ $_ := set $sched "affinity" . }}{{ end -}}
{{- with $e.priorityClassName }}{{ $_ := set $sched "priorityClassName" . }}{{ end -}}
{{- $out := dict "pod" $pod "scheduling" $sched -}}
{{- with $e.prometheusURL }}{{ $_ := set $out "prometheusUrl" . }}{{ end -}}
{{- toJson $out -}}
{{- end -}}
