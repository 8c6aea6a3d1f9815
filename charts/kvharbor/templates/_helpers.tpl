{{- define "kvharbor.labels" -}}
app.kubernetes.io/part-of: kvharbor
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- /* The Redis URL never appears in args, env values or ConfigMaps: every part reads it from
       one Secret (its name and key below) as KVHARBOR_REDIS_URL. That Secret is the user's
       (externalRedis.existingSecret, or redis.auth.existingSecret for the in-chart Redis) or the
       chart's own <release>-redis (templates/redis-secret.yaml). */ -}}
{{- define "kvharbor.inChartRedis" -}}
{{- if not (or .Values.externalRedis.url .Values.externalRedis.existingSecret) -}}true{{- end -}}
{{- end -}}

{{- define "kvharbor.redisSecretName" -}}
{{- if .Values.externalRedis.existingSecret -}}
{{ .Values.externalRedis.existingSecret }}
{{- else if and (include "kvharbor.inChartRedis" .) .Values.redis.auth.existingSecret -}}
{{ .Values.redis.auth.existingSecret }}
{{- else -}}
{{ .Release.Name }}-redis
{{- end -}}
{{- end -}}

{{- define "kvharbor.redisSecretKey" -}}
{{- if .Values.externalRedis.existingSecret -}}
{{ required "externalRedis.existingSecretKey is required" .Values.externalRedis.existingSecretKey }}
{{- else if and (include "kvharbor.inChartRedis" .) .Values.redis.auth.existingSecret -}}
{{ required "redis.auth.existingSecretUrlKey is required" .Values.redis.auth.existingSecretUrlKey }}
{{- else -}}
url
{{- end -}}
{{- end -}}

{{- /* The in-chart Redis's password: the Secret and key redis-server's requirepass reads. */ -}}
{{- define "kvharbor.redisPasswordSecretName" -}}
{{ .Values.redis.auth.existingSecret | default (printf "%s-redis" .Release.Name) }}
{{- end -}}

{{- define "kvharbor.redisPasswordSecretKey" -}}
{{- if .Values.redis.auth.existingSecret -}}
{{ required "redis.auth.existingSecretPasswordKey is required" .Values.redis.auth.existingSecretPasswordKey }}
{{- else -}}
password
{{- end -}}
{{- end -}}

{{- define "kvharbor.redisUrlEnv" -}}
- name: KVHARBOR_REDIS_URL
  valueFrom:
    secretKeyRef: {name: {{ include "kvharbor.redisSecretName" . | quote }}, key: {{ include "kvharbor.redisSecretKey" . | quote }}}
{{- end -}}

{{- /* Prometheus scrape annotations for a pod whose admin port is `port`. */ -}}
{{- define "kvharbor.scrapeAnnotations" -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ . | quote }}
prometheus.io/path: /metrics
{{- end -}}

{{- define "kvharbor.engineNamespace" -}}
{{ .Values.gateway.discoveryNamespace | default .Release.Namespace }}
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
