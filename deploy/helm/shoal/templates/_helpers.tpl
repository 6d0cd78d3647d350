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
{{- printf "%s://%s-nats.%s.svc:4222" (ternary "tls" "nats" .Values.nats.tls.enabled) (include "shoal.fullname" .) .Release.Namespace -}}
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

{{/* NATS's users and TLS (docs/operations.md, "The bus"). The Secret of the users' passwords
     (keys gateway-password, worker-password): the chart's own unless nats.auth.existingSecret. */}}
{{- define "shoal.natsUsersSecret" -}}
{{- default (printf "%s-nats-users" (include "shoal.fullname" .)) .Values.nats.auth.existingSecret -}}
{{- end -}}

{{/* Values of nats.auth and nats.tls that cannot work stop the render. */}}
{{- define "shoal.natsChecks" -}}
{{- $nats := .Values.nats -}}
{{- if and $nats.enabled $nats.auth.enabled $nats.auth.credsSecret -}}
{{- fail "nats.auth.credsSecret is for an existing NATS that signs its users (nats.enabled: false); the chart's NATS has users and passwords (nats.auth.existingSecret, or made by the chart)" -}}
{{- end -}}
{{- if and (not $nats.enabled) $nats.auth.enabled (not (or $nats.auth.existingSecret $nats.auth.credsSecret)) -}}
{{- fail "nats.auth: an existing NATS (nats.enabled: false) needs nats.auth.existingSecret (keys gateway-password, worker-password) or nats.auth.credsSecret (keys gateway.creds, worker.creds), or nats.auth.enabled: false" -}}
{{- end -}}
{{- if and $nats.tls.enabled (not $nats.tls.secretName) -}}
{{- fail "nats.tls.enabled needs nats.tls.secretName: a Secret with ca.crt (and for the chart's NATS its tls.crt and tls.key)" -}}
{{- end -}}
{{- end -}}

{{/* The environment that gives a gateway or a worker its NATS credentials and TLS:
     (list $root "gateway"|"worker"). No secret is in it: the password comes from the Secret. */}}
{{- define "shoal.natsEnv" -}}
{{- $root := index . 0 -}}{{- $role := index . 1 -}}
{{- $nats := $root.Values.nats -}}
{{- include "shoal.natsChecks" $root -}}
{{- if $nats.auth.enabled }}
{{- if $nats.auth.credsSecret }}
- {name: SHOAL_NATS_CREDS_FILE, value: {{ printf "/etc/shoal/nats/%s.creds" $role | quote }}}
{{- else }}
- {name: SHOAL_NATS_USER, value: {{ index $nats.auth (printf "%sUser" $role) | quote }}}
- name: SHOAL_NATS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "shoal.natsUsersSecret" $root | quote }}, key: {{ printf "%s-password" $role | quote }}}
{{- end }}
{{- end }}
{{- if $nats.tls.enabled }}
- {name: SHOAL_NATS_TLS_CA_FILE, value: /etc/shoal/nats-tls/ca.crt}
{{- if $nats.tls.clientSecretName }}
- {name: SHOAL_NATS_TLS_CERT_FILE, value: /etc/shoal/nats-client-tls/tls.crt}
- {name: SHOAL_NATS_TLS_KEY_FILE, value: /etc/shoal/nats-client-tls/tls.key}
{{- end }}
{{- end }}
{{- end -}}

{{- define "shoal.natsMounts" -}}
{{- $nats := .Values.nats -}}
{{- if and $nats.auth.enabled $nats.auth.credsSecret }}
- {name: nats-creds, mountPath: /etc/shoal/nats, readOnly: true}
{{- end }}
{{- if $nats.tls.enabled }}
- {name: nats-tls, mountPath: /etc/shoal/nats-tls, readOnly: true}
{{- if $nats.tls.clientSecretName }}
- {name: nats-client-tls, mountPath: /etc/shoal/nats-client-tls, readOnly: true}
{{- end }}
{{- end }}
{{- end -}}

{{/* (list $root "gateway"|"worker"): each process mounts only its own role's credentials. */}}
{{- define "shoal.natsVolumes" -}}
{{- $root := index . 0 -}}{{- $role := index . 1 -}}
{{- $nats := $root.Values.nats -}}
{{- if and $nats.auth.enabled $nats.auth.credsSecret }}
- name: nats-creds
  secret:
    secretName: {{ $nats.auth.credsSecret | quote }}
    items: [{key: {{ printf "%s.creds" $role | quote }}, path: {{ printf "%s.creds" $role | quote }}}]
{{- end }}
{{- if $nats.tls.enabled }}
- name: nats-tls
  secret:
    secretName: {{ $nats.tls.secretName | quote }}
    items: [{key: ca.crt, path: ca.crt}]
{{- if $nats.tls.clientSecretName }}
- name: nats-client-tls
  secret:
    secretName: {{ $nats.tls.clientSecretName | quote }}
    items: [{key: tls.crt, path: tls.crt}, {key: tls.key, path: tls.key}]
{{- end }}
{{- end }}
{{- end -}}

{{/* A role's permissions (files/nats-permissions.json, shoal.cluster.nats_auth.PERMISSIONS) in
     nats-server's configuration syntax: {publish: {allow: ["a", ...]} subscribe: {...}}. */}}
{{- define "shoal.natsPermissions" -}}
{{- $verbs := list -}}
{{- range $verb, $rules := . -}}
{{- $kinds := list -}}
{{- range $kind, $subjects := $rules -}}
{{- $quoted := list -}}
{{- range $subjects }}{{ $quoted = append $quoted (quote .) }}{{ end -}}
{{- $kinds = append $kinds (printf "%s: [%s]" $kind (join ", " $quoted)) -}}
{{- end -}}
{{- $verbs = append $verbs (printf "%s: {%s}" $verb (join ", " $kinds)) -}}
{{- end -}}
{{- printf "{%s}" (join ", " $verbs) -}}
{{- end -}}
