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

{{/* The image both console scripts run from. */}}
{{- define "lorafleet.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
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
