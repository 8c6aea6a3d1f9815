{{- define "kvharbor.labels" -}}
app.kubernetes.io/part-of: kvharbor
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "kvharbor.redisUrl" -}}
{{- if .Values.externalRedis.url -}}
{{ .Values.externalRedis.url }}
{{- else -}}
redis://{{ .Release.Name }}-redis:6379/0
{{- end -}}
{{- end -}}

{{- define "kvharbor.podSecurity" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "kvharbor.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}
