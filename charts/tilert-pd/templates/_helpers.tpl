{{/* Chart name, truncated to the 63 characters of a DNS label. */}}
{{- define "tilert-pd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name of every object: two releases never collide on cluster-scoped names. */}}
{{- define "tilert-pd.fullname" -}}
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

{{- define "tilert-pd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "tilert-pd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: tilert-pd
{{- end }}

{{/* Labels that select the operator pod; they never change across upgrades (selectors are immutable). */}}
{{- define "tilert-pd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tilert-pd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "tilert-pd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "tilert-pd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create=false: name an existing ServiceAccount in the release namespace" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "tilert-pd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "tilert-pd.webhookService" -}}
{{- printf "%s-webhook" (include "tilert-pd.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "tilert-pd.webhookSecret" -}}
{{- default (printf "%s-webhook-tls" (include "tilert-pd.fullname" .)) .Values.webhook.tls.secretName }}
{{- end }}

{{/* Where the webhook's certificate is mounted; the operator reads the paths from its environment. */}}
{{- define "tilert-pd.webhookCertDir" -}}
/etc/tilert-pd/webhook
{{- end }}
