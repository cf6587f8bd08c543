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

{{/* Router resource name: FULLNAME-router (the full name cut so that the result fits 63). */}}
{{- define "vllm-kvcomp.routerName" -}}
{{- printf "%s-router" (include "vllm-kvcomp.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{/* Labels that select the router pods. Their app.kubernetes.io/name differs from the server
pods', so the server Service, the ServiceMonitor and the router's pod discovery never match them. */}}
{{- define "vllm-kvcomp.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-router" (include "vllm-kvcomp.name" . | trunc 56 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels on every router resource. */}}
{{- define "vllm-kvcomp.routerLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "vllm-kvcomp.routerSelectorLabels" . }}
app.kubernetes.io/component: router
app.kubernetes.io/part-of: {{ include "vllm-kvcomp.name" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The server pods' selector labels as a Kubernetes label selector (k1=v1,k2=v2). */}}
{{- define "vllm-kvcomp.serverLabelSelector" -}}
{{- $labels := include "vllm-kvcomp.selectorLabels" . | fromYaml }}
{{- $terms := list }}
{{- range $key := keys $labels | sortAlpha }}
{{- $terms = append $terms (printf "%s=%s" $key (get $labels $key)) }}
{{- end }}
{{- join "," $terms }}
{{- end }}

{{/*
Value combinations the schema cannot state with a clear message (it checks one field at a
time). Included by deployment.yaml, so helm install / upgrade / template / lint all stop here.
*/}}
{{- define "vllm-kvcomp.validate" -}}
{{- $v := .Values }}
{{- $replicas := int $v.replicaCount }}
{{- $hpa := $v.autoscaling }}
{{- if $hpa.enabled }}
{{- if ne $replicas 1 }}
{{- fail (printf "replicaCount (%d) conflicts with autoscaling.enabled: the HorizontalPodAutoscaler owns the replica count. Leave replicaCount at 1 and set autoscaling.minReplicas / autoscaling.maxReplicas." $replicas) }}
{{- end }}
{{- if gt (int $hpa.minReplicas) (int $hpa.maxReplicas) }}
{{- fail (printf "autoscaling.minReplicas (%d) is above autoscaling.maxReplicas (%d)." (int $hpa.minReplicas) (int $hpa.maxReplicas)) }}
{{- end }}
{{- end }}
{{- $tensor := int $v.parallelism.tensor }}
{{- $data := int $v.parallelism.data }}
{{- if and (gt (int $v.gpu.count) 0) (lt (int $v.gpu.count) (mul $tensor $data)) }}
{{- fail (printf "gpu.count (%d) is less than parallelism.tensor x parallelism.data (%d x %d = %d): each data-parallel engine needs parallelism.tensor GPUs of its own." (int $v.gpu.count) $tensor $data (mul $tensor $data)) }}
{{- end }}
{{- range $v.server.extraArgs }}
{{- $flag := toString . | lower | replace "_" "-" | splitList "=" | first }}
{{- if has $flag (list "--tensor-parallel-size" "-tp") }}
{{- fail (printf "server.extraArgs sets %s: set parallelism.tensor instead (the chart checks it against gpu.count)." .) }}
{{- end }}
{{- if has $flag (list "--data-parallel-size" "-dp") }}
{{- fail (printf "server.extraArgs sets %s: set parallelism.data instead (the chart checks it against gpu.count and the router)." .) }}
{{- end }}
{{- end }}
{{- $router := $v.router }}
{{- if $router.enabled }}
{{- if and $hpa.enabled (lt (int $hpa.minReplicas) 2) }}
{{- fail (printf "router.enabled needs 2 or more server pods to route between: set autoscaling.minReplicas to 2 or more (now %d)." (int $hpa.minReplicas)) }}
{{- end }}
{{- if and (not $hpa.enabled) (lt $replicas 2) }}
{{- fail (printf "router.enabled needs 2 or more server pods to route between: set replicaCount to 2 or more (now %d), or enable autoscaling with autoscaling.minReplicas 2 or more." $replicas) }}
{{- end }}
{{- if gt $data 1 }}
{{- fail (printf "router.enabled with parallelism.data %d: the router picks a pod, but vLLM spreads a pod's requests over its data-parallel engines by load, so a conversation would not stay on the engine that holds its prefix. Keep parallelism.data at 1 and scale out with replicaCount or autoscaling." $data) }}
{{- end }}
{{- if and (eq $router.routing "prefix") (gt (int $router.replicaCount) 1) }}
{{- fail (printf "router.routing prefix with router.replicaCount %d: each router pod keeps its own prefix table, so two router pods would send one conversation to different server pods. Use router.routing session, or router.replicaCount 1." (int $router.replicaCount)) }}
{{- end }}
{{- end }}
{{- end }}
