{{/* The seven roles, in start order; each has a values key (camelCase). */}}
{{- define "noetl.roles" -}}
api shard-manager projector checkpointer compactor reaper worker
{{- end -}}

{{- define "noetl.roleKey" -}}
{{- if eq . "shard-manager" -}}shardManager{{- else -}}{{ . }}{{- end -}}
{{- end -}}

{{/* Roles that talk to NATS, and roles that build the result store (S3 credentials). */}}
{{- define "noetl.natsRoles" -}}
api projector checkpointer reaper worker
{{- end -}}
{{- define "noetl.resultStoreRoles" -}}
api worker
{{- end -}}

{{- define "noetl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "noetl.fullname" -}}
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

{{- define "noetl.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Names of a role's objects. Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.roleFullname" -}}
{{- printf "%s-%s" (include "noetl.fullname" .root | trunc 48 | trimSuffix "-") .role -}}
{{- end -}}
{{- define "noetl.headlessName" -}}
{{- printf "%s-headless" (include "noetl.roleFullname" .) -}}
{{- end -}}

{{- define "noetl.commonLabels" -}}
helm.sh/chart: {{ include "noetl.chart" . }}
app.kubernetes.io/name: {{ include "noetl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: noetl
{{- end -}}

{{/* Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.labels" -}}
{{ include "noetl.commonLabels" .root }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "noetl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "noetl.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "noetl.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "noetl.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.image" -}}
{{- $img := .root.Values.image -}}
{{- printf "%s-%s:%s" $img.repository .role (default .root.Chart.AppVersion $img.tag) -}}
{{- end -}}

{{/* gRPC target of a role: DNS over its headless Service, balanced client-side
     (round_robin, configured by the runtime's channels). Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.grpcTarget" -}}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "noetl.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain (int .root.Values.ports.grpc) -}}
{{- end -}}

{{- define "noetl.configName" -}}
{{- printf "%s-config" (include "noetl.fullname" .) -}}
{{- end -}}

{{/* Environment entries for the runtime's credentials. Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.credentialEnv" -}}
{{- $v := .root.Values -}}
- name: NOETL_POSTGRES_DSN
  valueFrom:
    secretKeyRef:
      name: {{ $v.postgres.existingSecret }}
      key: {{ $v.postgres.dsnKey }}
{{- if has .role (splitList " " (include "noetl.natsRoles" .root)) }}
{{- if $v.nats.existingSecret }}
- name: NOETL_NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $v.nats.existingSecret }}
      key: {{ $v.nats.urlKey }}
{{- else }}
- name: NOETL_NATS_URL
  value: {{ $v.nats.url | quote }}
{{- end }}
{{- end }}
{{- if and $v.resultStore.s3.existingSecret (has .role (splitList " " (include "noetl.resultStoreRoles" .root))) }}
- name: NOETL_RESULT_S3_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.resultStore.s3.existingSecret }}
      key: {{ $v.resultStore.s3.accessKeyKey }}
- name: NOETL_RESULT_S3_SECRET_KEY
  valueFrom:
    secretKeyRef:
      name: {{ $v.resultStore.s3.existingSecret }}
      key: {{ $v.resultStore.s3.secretKeyKey }}
{{- end }}
{{- if and $v.tracing.existingSecret (eq $v.tracing.exporter "otlp") }}
- name: OTEL_EXPORTER_OTLP_HEADERS
  valueFrom:
    secretKeyRef:
      name: {{ $v.tracing.existingSecret }}
      key: {{ $v.tracing.headersKey }}
{{- end }}
{{- end -}}

{{/* Label matcher every alert expression carries. */}}
{{- define "noetl.alertSelector" -}}
{{- if .Values.metrics.prometheusRule.matchNamespace -}}
namespace={{ .Release.Namespace | quote }}
{{- end -}}
{{- end -}}
