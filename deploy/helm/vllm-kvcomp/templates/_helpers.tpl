{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "vllm-kvcomp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full resource name: fullnameOverride, or RELEASE-NAME (RELEASE when it contains NAME). */}}
{{- define "vllm-kvcomp.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "vllm-kvcomp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "vllm-kvcomp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the server pods. */}}
{{- define "vllm-kvcomp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-kvcomp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Service account of the pods. */}}
{{- define "vllm-kvcomp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "vllm-kvcomp.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Server image reference. */}}
{{- define "vllm-kvcomp.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Path of the rendered operator compression config inside the server container. */}}
{{- define "vllm-kvcomp.configPath" -}}
/etc/vllm-kvcomp/kv-compression.yaml
{{- end }}
