{{/* Names and labels. */}}
{{- define "deepinfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "deepinfer.fullname" -}}
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

{{- define "deepinfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "deepinfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "deepinfer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "deepinfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The image: tag defaults to the accelerator's image (cpu / nvidia / ascend). */}}
{{- define "deepinfer.image" -}}
{{- $default := get (dict "none" "cpu" "nvidia" "nvidia" "ascend" "ascend") .Values.accelerator.type }}
{{- printf "%s:%s" .Values.image.repository (default $default .Values.image.tag) }}
{{- end }}

{{/* --device: server.device, else the accelerator's. */}}
{{- define "deepinfer.device" -}}
{{- default (get (dict "none" "cpu" "nvidia" "cuda" "ascend" "npu") .Values.accelerator.type) .Values.server.device }}
{{- end }}

{{/* The checkpoint's path inside the pod. */}}
{{- define "deepinfer.modelPath" -}}
{{- if .Values.model.subPath }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) .Values.model.subPath }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{/* The Secret that holds the API key ("" = no key). */}}
{{- define "deepinfer.apiKeySecret" -}}
{{- if and .Values.apiKey.create .Values.apiKey.existingSecret }}
{{- fail "apiKey: set either existingSecret or create, not both" }}
{{- end }}
{{- if .Values.apiKey.create }}
{{- printf "%s-api-key" (include "deepinfer.fullname" .) }}
{{- else }}
{{- .Values.apiKey.existingSecret }}
{{- end }}
{{- end }}

{{/* The accelerator's extended resource ("" for the CPU). */}}
{{- define "deepinfer.acceleratorResource" -}}
{{- if ne .Values.accelerator.type "none" }}
{{- get .Values.accelerator.resourceNames .Values.accelerator.type }}
{{- end }}
{{- end }}
