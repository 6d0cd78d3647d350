{{/* Names, labels and the values every template derives the same way. */}}

{{- define "shoal.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "shoal.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "shoal.labels" -}}
{{ include "shoal.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: shoal
{{- end -}}

{{/* A worker pool's labels, and the subset that selects its pods: (list $root $poolName). */}}
{{- define "shoal.workerSelector" -}}
{{- $root := index . 0 -}}
{{ include "shoal.selectorLabels" $root }}
app.kubernetes.io/component: worker
shoal.dev/pool: {{ index . 1 | quote }}
{{- end -}}

{{- define "shoal.workerLabels" -}}
{{- $root := index . 0 -}}
{{ include "shoal.labels" $root }}
app.kubernetes.io/component: worker
shoal.dev/pool: {{ index . 1 | quote }}
{{- end -}}

{{- define "shoal.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "shoal.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "shoal.image" -}}
{{- $image := index . 0 -}}{{- $root := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{- define "shoal.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s-nats.%s.svc:4222" (include "shoal.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "nats.url is required when nats.enabled is false (an existing NATS with JetStream)" .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{- define "shoal.natsMonitoring" -}}
{{- if .Values.nats.enabled -}}
{{- printf "%s-nats.%s.svc.cluster.local:8222" (include "shoal.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "nats.monitoringEndpoint (host:8222) is required for KEDA's nats-jetstream trigger when nats.enabled is false" .Values.nats.monitoringEndpoint -}}
{{- end -}}
{{- end -}}

{{/* A name as shoal.cluster.protocol.token writes it: letters, digits and "-" stay, every other
     character is "_" and its byte in hex. "_" goes first, so the escapes are not escaped again;
     a character without a rule here stops the render (the chart would name the wrong consumer). */}}
{{- define "shoal.token" -}}
{{- $t := . | replace "_" "_5f" | replace "/" "_2f" | replace "." "_2e" | replace ":" "_3a" | replace "@" "_40" | replace "+" "_2b" | replace "=" "_3d" | replace "," "_2c" | replace "~" "_7e" -}}
{{- if not (regexMatch "^[A-Za-z0-9_-]+$" $t) -}}
{{- fail (printf "model id or pool %q has a character the chart cannot turn into a JetStream consumer name (it knows / . : @ + = , ~ _)" .) -}}
{{- end -}}
{{- $t -}}
{{- end -}}

{{/* The models the gateway offers: gateway.models, else every pool's, else (a pool serving every
     card) all of them: an empty list. */}}
{{- define "shoal.gatewayModels" -}}
{{- $models := list -}}
{{- $all := false -}}
{{- range .Values.pools -}}
{{- if not .models -}}{{- $all = true -}}{{- end -}}
{{- $models = concat $models (default list .models) -}}
{{- end -}}
{{- if .Values.gateway.models -}}
{{- join "," .Values.gateway.models -}}
{{- else if not $all -}}
{{- join "," (uniq $models) -}}
{{- end -}}
{{- end -}}

{{/* The flags every shoal process of the release shares. */}}
{{- define "shoal.commonArgs" -}}
- --nats-url
- {{ include "shoal.natsUrl" . | quote }}
- --ack-wait-s
- {{ .Values.queue.ackWaitS | quote }}
- --max-deliver
- {{ .Values.queue.maxDeliver | quote }}
{{- if .Values.cards }}
- --models-dir
- /etc/shoal/models
{{- end }}
{{- end -}}

{{- define "shoal.cardsVolume" -}}
{{- if .Values.cards }}
- name: cards
  configMap:
    name: {{ include "shoal.fullname" . }}-cards
{{- end }}
{{- end -}}
