{{- define "kascade.labels" -}}
app.kubernetes.io/part-of: kascade
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/instance: {{ .Release.Name }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "kascade.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "kascade.tokenSecret" -}}
{{ .Values.engineToken.existingSecret | default (printf "%s-engine-token" .Release.Name) }}
{{- end -}}
