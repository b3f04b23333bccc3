{{/* Chart name, overridable. */}}
{{- define "lorafleet.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Resource-name prefix: the release name, plus the chart name unless already in it. */}}
{{- define "lorafleet.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels every resource carries (components add their selector labels, which hold
     app.kubernetes.io/name and app.kubernetes.io/instance). */}}
{{- define "lorafleet.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lorafleet
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels of resources that belong to no single component (LoraFleet). */}}
{{- define "lorafleet.releaseLabels" -}}
app.kubernetes.io/name: {{ include "lorafleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector labels of the operator pods. */}}
{{- define "lorafleet.operator.selectorLabels" -}}
app.kubernetes.io/name: lorafleet-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* Selector labels of the agent pods; the chart's LoraFleet selects exactly these. */}}
{{- define "lorafleet.agent.selectorLabels" -}}
app.kubernetes.io/name: lorafleet-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The operator image (Containerfile target `operator`). */}}
{{- define "lorafleet.operatorImage" -}}
{{- $tag := .Values.image.operator.tag | default .Values.image.tag | default .Chart.AppVersion -}}
{{- printf "%s:%s" .Values.image.operator.repository $tag -}}
{{- end -}}

{{/* The node-agent image (Containerfile target `agent`); also runs the model download and
     the `helm test` pod. */}}
{{- define "lorafleet.agentImage" -}}
{{- $tag := .Values.image.agent.tag | default .Values.image.tag | default .Chart.AppVersion -}}
{{- printf "%s:%s" .Values.image.agent.repository $tag -}}
{{- end -}}

{{/* The stock vLLM OpenAI server image of agent.backend=vllm. */}}
{{- define "lorafleet.vllmImage" -}}
{{- printf "%s:%s" .Values.agent.vllm.image .Values.agent.vllm.tag -}}
{{- end -}}

{{/* The name of vLLM server N's container port (the operator's EndpointSlices and the
     Services find the first one by its name, vllm-http). Called with the server's index. */}}
{{- define "lorafleet.vllmPortName" -}}
{{- if eq (int .) 0 }}vllm-http{{ else }}{{ printf "vllm-http-%d" (int .) }}{{ end -}}
{{- end -}}

{{/* The bearer-token Secret: the user's, or the one the chart creates. */}}
{{- define "lorafleet.authSecretName" -}}
{{- .Values.auth.existingSecret | default (printf "%s-agent-token" (include "lorafleet.fullname" .)) -}}
{{- end -}}

{{/* Seconds the agents' start-up probe allows: the engine's start-up budget plus 60 s for
     the interpreter's imports and binding the port, so that the engine's own time-out (and its
     message in the log) comes first. */}}
{{- define "lorafleet.startupProbeSeconds" -}}
{{- add (int .Values.agent.startupTimeoutSeconds) 60 -}}
{{- end -}}

{{/* The user and group every container the chart runs has (the images' user). */}}
{{- define "lorafleet.runAsIds" -}}
runAsUser: 65532
runAsGroup: 65532
{{- end -}}

{{/* Pod and container security contexts of every pod the chart runs (the images' user). */}}
{{- define "lorafleet.podSecurityContext" -}}
runAsNonRoot: true
{{ include "lorafleet.runAsIds" . }}
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "lorafleet.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "lorafleet.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (printf "%s-operator" (include "lorafleet.fullname" .)) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Namespaces the operator manages, comma-separated (the release namespace by default). */}}
{{- define "lorafleet.watchNamespaces" -}}
{{- if .Values.operator.watchNamespaces -}}
{{- join "," .Values.operator.watchNamespaces -}}
{{- else -}}
{{- .Release.Namespace -}}
{{- end -}}
{{- end -}}
