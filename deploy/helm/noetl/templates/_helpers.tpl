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
{{- $ref := printf "%s-%s:%s" $img.repository .role (default .root.Chart.AppVersion $img.tag) -}}
{{- with ((.root.Values.global).imageRegistry) }}{{ $ref = printf "%s/%s" (trimSuffix "/" .) $ref }}{{ end -}}
{{- with index ($img.digests | default dict) (include "noetl.roleKey" .role) }}{{ $ref = printf "%s@%s" $ref . }}{{ end -}}
{{- $ref -}}
{{- end -}}

{{/* An image that is not the runtime's (lite mode's Postgres and NATS): global.imageRegistry
     in front, the digest pinned when given. Context: dict "root" $ "image" {repository, tag, digest} */}}
{{- define "noetl.otherImage" -}}
{{- $ref := printf "%s:%s" .image.repository (toString .image.tag) -}}
{{- with ((.root.Values.global).imageRegistry) }}{{ $ref = printf "%s/%s" (trimSuffix "/" .) $ref }}{{ end -}}
{{- with .image.digest }}{{ $ref = printf "%s@%s" $ref . }}{{ end -}}
{{- $ref -}}
{{- end -}}

{{/* A role's pod labels: podLabels, the role's podLabels over them, the chart's own labels
     over both (they select the pods). Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.podLabels" -}}
{{- $rv := index .root.Values (include "noetl.roleKey" .role) -}}
{{- $own := include "noetl.labels" . | fromYaml -}}
{{- toYaml (merge $own (deepCopy ($rv.podLabels | default dict)) (deepCopy (.root.Values.podLabels | default dict))) -}}
{{- end -}}

{{/* Volume names the chart uses itself (extraVolumes may not take them). */}}
{{- define "noetl.reservedVolumes" -}}
tmp tls postgres-ca nats-ca nats-creds auth
{{- end -}}

{{/* gRPC target of a role: DNS over its headless Service, balanced client-side
     (round_robin, configured by the runtime's channels). Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.grpcTarget" -}}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "noetl.headlessName" .) .root.Release.Namespace .root.Values.clusterDomain (int .root.Values.ports.grpc) -}}
{{- end -}}

{{/* The workers' target of the api's WorkerService: its own port on the same headless Service. */}}
{{- define "noetl.workerApiTarget" -}}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "noetl.headlessName" (dict "root" . "role" "api")) .Release.Namespace .Values.clusterDomain (int .Values.ports.workerApi) -}}
{{- end -}}

{{- define "noetl.configName" -}}
{{- printf "%s-config" (include "noetl.fullname" .) -}}
{{- end -}}

{{/* Mount points of the files the chart gives the pods. */}}
{{- define "noetl.paths" -}}
tls: /etc/noetl/tls
auth: /etc/noetl/auth
postgresCa: /etc/noetl/postgres-ca
natsCa: /etc/noetl/nats-ca
natsCreds: /etc/noetl/nats
{{- end -}}

{{/* Secret of the release's tokens (generated unless auth.existingSecret). */}}
{{- define "noetl.authSecretName" -}}
{{- default (printf "%s-auth" (include "noetl.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Keys of the tokens Secret: one per role, and admin. */}}
{{- define "noetl.tokenKeys" -}}
{{ include "noetl.roles" . }} admin
{{- end -}}

{{/* The token role (noetl_common.auth.Role) of a release role's token. */}}
{{- define "noetl.tokenRole" -}}
{{- if eq . "worker" -}}worker{{- else if eq . "admin" -}}admin{{- else -}}service{{- end -}}
{{- end -}}

{{/* A role's TLS Secret. Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.tlsSecretName" -}}
{{- $tls := .root.Values.tls -}}
{{- if $tls.certManager.enabled -}}
{{- printf "%s-tls" (include "noetl.roleFullname" .) -}}
{{- else -}}
{{- default $tls.existingSecret (index $tls.roleSecrets (include "noetl.roleKey" .role)) -}}
{{- end -}}
{{- end -}}

{{/* The Secret holding a role's DSN. Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.postgresSecretName" -}}
{{- $pg := .root.Values.postgres -}}
{{- default $pg.existingSecret (index $pg.roleSecrets (include "noetl.roleKey" .role)) -}}
{{- end -}}

{{/* DNS names of a role's Services (the names its clients dial), one per line.
     Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.serviceDnsNames" -}}
{{- $ns := .root.Release.Namespace -}}
{{- $domain := .root.Values.clusterDomain -}}
{{- $names := list (include "noetl.headlessName" .) -}}
{{- if eq .role "api" -}}
{{- $names = append $names (include "noetl.roleFullname" .) -}}
{{- end -}}
{{- range $names }}
{{ . }}
{{ . }}.{{ $ns }}
{{ . }}.{{ $ns }}.svc
{{ . }}.{{ $ns }}.svc.{{ $domain }}
{{- end -}}
{{- end -}}

{{/* Environment entries for the runtime's identity, TLS and credentials: each role gets
     only what it uses. Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.credentialEnv" -}}
{{- $v := .root.Values -}}
{{- $paths := include "noetl.paths" . | fromYaml -}}
{{- $roleKey := include "noetl.roleKey" .role -}}
- name: NOETL_POSTGRES_DSN
  valueFrom:
    secretKeyRef:
      name: {{ include "noetl.postgresSecretName" . }}
      key: {{ index $v.postgres.dsnKeys $roleKey }}
- name: NOETL_AUTH_ENABLED
  value: {{ $v.auth.enabled | quote }}
{{- if $v.auth.enabled }}
- name: NOETL_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "noetl.authSecretName" .root }}
      key: {{ .role }}
{{- end }}
{{- if $v.tls.enabled }}
- name: NOETL_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $paths.tls | quote }}
- name: NOETL_TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" $paths.tls | quote }}
- name: NOETL_TLS_KEY_FILE
  value: {{ printf "%s/tls.key" $paths.tls | quote }}
- name: NOETL_TLS_CLIENT_AUTH
  value: {{ $v.tls.clientAuth | quote }}
{{- with $v.tls.serverName }}
- name: NOETL_TLS_SERVER_NAME
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- if eq .role "api" }}
- name: NOETL_CREDENTIALS_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ $v.credentials.existingSecret }}
      key: {{ $v.credentials.keysKey }}
{{- end }}
{{- if has .role (splitList " " (include "noetl.natsRoles" .root)) }}
{{- if $v.nats.existingSecret }}
- name: NOETL_NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $v.nats.existingSecret }}
      key: {{ index $v.nats.urlKeys $roleKey }}
{{- else }}
- name: NOETL_NATS_URL
  value: {{ $v.nats.url | quote }}
{{- end }}
{{- if $v.nats.ca.existingSecret }}
- name: NOETL_NATS_TLS_CA_FILE
  value: {{ printf "%s/ca.crt" $paths.natsCa | quote }}
{{- end }}
{{- if $v.nats.credsSecret }}
- name: NOETL_NATS_CREDS_FILE
  value: {{ printf "%s/nats.creds" $paths.natsCreds | quote }}
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

{{/* volumeMounts and volumes (two YAML lists under the keys "mounts" and "volumes") of the
     Secret files a role needs: its TLS certificate, the Postgres CA, the NATS CA and its own
     NATS creds file. Context: dict "root" $ "role" ROLE */}}
{{- define "noetl.secretVolumes" -}}
{{- $v := .root.Values -}}
{{- $paths := include "noetl.paths" . | fromYaml -}}
{{- $nats := has .role (splitList " " (include "noetl.natsRoles" .root)) -}}
mounts:
{{- if $v.tls.enabled }}
  - {name: tls, mountPath: {{ $paths.tls }}, readOnly: true}
{{- end }}
{{- if $v.postgres.ca.existingSecret }}
  - {name: postgres-ca, mountPath: {{ $paths.postgresCa }}, readOnly: true}
{{- end }}
{{- if and $nats $v.nats.ca.existingSecret }}
  - {name: nats-ca, mountPath: {{ $paths.natsCa }}, readOnly: true}
{{- end }}
{{- if and $nats $v.nats.credsSecret }}
  - {name: nats-creds, mountPath: {{ $paths.natsCreds }}, readOnly: true}
{{- end }}
volumes:
{{- if $v.tls.enabled }}
  - name: tls
    secret:
      secretName: {{ include "noetl.tlsSecretName" . }}
      defaultMode: 0440
      items:
        - {key: tls.crt, path: tls.crt}
        - {key: tls.key, path: tls.key}
        - {key: ca.crt, path: ca.crt}
{{- end }}
{{- if $v.postgres.ca.existingSecret }}
  - name: postgres-ca
    secret:
      secretName: {{ $v.postgres.ca.existingSecret }}
      defaultMode: 0444
      items:
        - {key: {{ $v.postgres.ca.key }}, path: ca.crt}
{{- end }}
{{- if and $nats $v.nats.ca.existingSecret }}
  - name: nats-ca
    secret:
      secretName: {{ $v.nats.ca.existingSecret }}
      defaultMode: 0444
      items:
        - {key: {{ $v.nats.ca.key }}, path: ca.crt}
{{- end }}
{{- if and $nats $v.nats.credsSecret }}
  - name: nats-creds
    secret:
      secretName: {{ $v.nats.credsSecret }}
      defaultMode: 0440
      items:
        - {key: {{ printf "%s.creds" .role }}, path: nats.creds}
{{- end }}
{{- end -}}

{{/* Label matcher every alert expression carries. */}}
{{- define "noetl.alertSelector" -}}
{{- if .Values.metrics.prometheusRule.matchNamespace -}}
namespace={{ .Release.Namespace | quote }}
{{- end -}}
{{- end -}}

{{/* ---------------------------------------------------------------- checks
     Refuse to render values the runtime cannot run with, naming the value. */}}
{{- define "noetl.validate" -}}
{{- $v := .Values -}}
{{- if $v.lite.enabled -}}
{{- include "noetl.validateLite" . -}}
{{- else -}}
{{- include "noetl.validateRoles" . -}}
{{- end -}}
{{- end -}}

{{/* Lite mode: one evaluation pod; what it cannot do. */}}
{{- define "noetl.validateLite" -}}
{{- $v := .Values -}}
{{- if not (semverCompare ">=1.29.0-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "lite.enabled needs Kubernetes 1.29 or later (native sidecar containers run its Postgres and NATS); this cluster is %s" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if or $v.autoscaling.worker.enabled $v.autoscaling.api.enabled -}}
{{- fail "lite.enabled runs one pod: autoscaling.worker.enabled and autoscaling.api.enabled must be false" -}}
{{- end -}}
{{- if $v.api.grpcRoute.enabled -}}
{{- fail "lite.enabled: api.grpcRoute is not available in lite mode (its generated CA is not published for a Gateway); use kubectl port-forward or api.ingress with tlsMode=passthrough" -}}
{{- end -}}
{{- if and $v.api.ingress.enabled (ne $v.api.ingress.tlsMode "passthrough") $v.tls.enabled -}}
{{- fail "lite.enabled: api.ingress needs tlsMode=passthrough (the api's generated certificate names api.ingress.host)" -}}
{{- end -}}
{{- if and $v.auth.enabled $v.auth.register (not $v.migration.enabled) -}}
{{- fail "auth.register needs migration.enabled: the migration registers the tokens" -}}
{{- end -}}
{{- end -}}

{{/* A Deployment per role: every value they need, named when missing. */}}
{{- define "noetl.validateRoles" -}}
{{- $v := .Values -}}
{{- $ports := dict -}}
{{- range $name := list "grpc" "workerApi" "health" "metrics" -}}
{{- $p := toString (index $v.ports $name) -}}
{{- if hasKey $ports $p -}}
{{- fail (printf "ports.%s and ports.%s are both %s: every port must differ" (get $ports $p) $name $p) -}}
{{- end -}}
{{- $_ := set $ports $p $name -}}
{{- end -}}
{{- range $role := splitList " " (include "noetl.roles" .) -}}
{{- $key := include "noetl.roleKey" $role -}}
{{- if not (include "noetl.postgresSecretName" (dict "root" $ "role" $role)) -}}
{{- fail (printf "postgres.existingSecret is empty (and postgres.roleSecrets.%s is not set): the %s role needs its Postgres DSN from a Secret (docs/DEPLOY.md \"Security\")" $key $role) -}}
{{- end -}}
{{- if not (index $v.postgres.dsnKeys $key) -}}
{{- fail (printf "postgres.dsnKeys.%s is empty: name the key of the %s role's DSN in its Secret" $key $role) -}}
{{- end -}}
{{- end -}}
{{- if and $v.migration.enabled (not $v.postgres.existingSecret) -}}
{{- fail "postgres.existingSecret is empty: the migration Job reads the owner DSN (postgres.ownerDsnKey) from it" -}}
{{- end -}}
{{- if and $v.migration.enabled (not $v.postgres.ownerDsnKey) -}}
{{- fail "postgres.ownerDsnKey is empty: the migration Job needs the schema owner's DSN" -}}
{{- end -}}
{{- if not $v.credentials.existingSecret -}}
{{- fail "credentials.existingSecret is empty: the api encrypts stored credentials with the master key NOETL_CREDENTIALS_KEYS from a Secret (docs/DEPLOY.md \"Credentials master key\" shows how to create it)" -}}
{{- end -}}
{{- if not $v.credentials.keysKey -}}
{{- fail "credentials.keysKey is empty: name the key of NOETL_CREDENTIALS_KEYS in credentials.existingSecret" -}}
{{- end -}}
{{- if and $v.tls.clientAuth (not $v.tls.enabled) -}}
{{- fail "tls.clientAuth needs tls.enabled: mutual TLS is TLS with client certificates" -}}
{{- end -}}
{{- if and $v.tls.certManager.enabled (not $v.tls.enabled) -}}
{{- fail "tls.certManager.enabled needs tls.enabled" -}}
{{- end -}}
{{- if $v.tls.enabled -}}
{{- if $v.tls.certManager.enabled -}}
{{- if not $v.tls.certManager.issuerRef.name -}}
{{- fail "tls.certManager.issuerRef.name is empty: name the cert-manager Issuer (or ClusterIssuer: issuerRef.kind) that signs the roles' certificates" -}}
{{- end -}}
{{- else -}}
{{- range $role := splitList " " (include "noetl.roles" .) -}}
{{- if not (include "noetl.tlsSecretName" (dict "root" $ "role" $role)) -}}
{{- fail (printf "tls.existingSecret is empty (and tls.roleSecrets.%s is not set): TLS is on (tls.enabled) and the %s role needs a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt, or set tls.certManager.enabled (docs/DEPLOY.md \"Certificates\")" (include "noetl.roleKey" $role) $role) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $role := splitList " " (include "noetl.roles" .) -}}
{{- $key := include "noetl.roleKey" $role -}}
{{- $seen := dict -}}
{{- range $vol := concat ($v.extraVolumes | default list) ((index $v $key).extraVolumes | default list) -}}
{{- if hasKey $seen $vol.name -}}
{{- fail (printf "extraVolumes: the volume name %q is used twice in the %s role's pods (extraVolumes and %s.extraVolumes together)" $vol.name $role $key) -}}
{{- end -}}
{{- $_ := set $seen $vol.name true -}}
{{- end -}}
{{- range $m := concat ($v.extraVolumeMounts | default list) ((index $v $key).extraVolumeMounts | default list) -}}
{{- if not (hasKey $seen $m.name) -}}
{{- fail (printf "extraVolumeMounts: the %s role mounts a volume %q that neither extraVolumes nor %s.extraVolumes defines" $role $m.name $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- range $role := list "worker" "api" -}}
{{- $a := index $v.autoscaling $role -}}
{{- if $a.enabled -}}
{{- if lt (int $a.maxReplicas) (int $a.minReplicas) -}}
{{- fail (printf "autoscaling.%s.maxReplicas (%v) is below autoscaling.%s.minReplicas (%v)" $role $a.maxReplicas $role $a.minReplicas) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with $v.autoscaling.worker -}}
{{- if and .enabled (not .prometheus.enabled) (not .natsJetstream.enabled) -}}
{{- fail "autoscaling.worker.enabled needs a trigger: autoscaling.worker.prometheus.enabled and/or autoscaling.worker.natsJetstream.enabled" -}}
{{- end -}}
{{- end -}}
{{- if $v.autoscaling.api.enabled -}}
{{- $shards := int (default 16 (index $v.config "NOETL_SHARD_COUNT")) -}}
{{- if gt (int $v.autoscaling.api.maxReplicas) $shards -}}
{{- fail (printf "autoscaling.api.maxReplicas (%v) is above NOETL_SHARD_COUNT (%d): api replicas beyond the shard count would hold no shard" $v.autoscaling.api.maxReplicas $shards) -}}
{{- end -}}
{{- end -}}
{{- with $v.api.ingress -}}
{{- if .enabled -}}
{{- if not .host -}}
{{- fail "api.ingress.host is empty: name the host clients dial through the Ingress" -}}
{{- end -}}
{{- if and (eq .tlsMode "passthrough") (not $v.tls.enabled) -}}
{{- fail "api.ingress.tlsMode=passthrough needs tls.enabled: the api terminates the clients' TLS itself (or use tlsMode=terminate)" -}}
{{- end -}}
{{- if eq .tlsMode "terminate" -}}
{{- if not .secretName -}}
{{- fail "api.ingress.secretName is empty: with tlsMode=terminate the Ingress serves the clients' TLS with a certificate for api.ingress.host from that Secret" -}}
{{- end -}}
{{- if and $v.tls.enabled .nginxAnnotations (not .backendCaSecret) -}}
{{- fail "api.ingress.backendCaSecret is empty: with tlsMode=terminate and tls.enabled, ingress-nginx re-encrypts to the api and must verify its certificate; name a Secret holding only the CA (key ca.crt) that signed it" -}}
{{- end -}}
{{- if $v.tls.clientAuth -}}
{{- fail "api.ingress.tlsMode=terminate cannot be used with tls.clientAuth: the controller has no client certificate for the api; use tlsMode=passthrough" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- with $v.api.grpcRoute -}}
{{- if .enabled -}}
{{- if not .parentRefs -}}
{{- fail "api.grpcRoute.parentRefs is empty: name the Gateway (and listener) the GRPCRoute attaches to" -}}
{{- end -}}
{{- if $v.tls.clientAuth -}}
{{- fail "api.grpcRoute cannot be used with tls.clientAuth: a Gateway presents no client certificate to the api" -}}
{{- end -}}
{{- if and $v.tls.enabled (not .backendTLS.caCertificateRefs) (not .backendTLS.wellKnownCACertificates) -}}
{{- fail "api.grpcRoute.backendTLS.caCertificateRefs is empty: with tls.enabled the Gateway must verify the api's certificate; name a ConfigMap with its CA (ca.crt), or set backendTLS.wellKnownCACertificates=System" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and $v.auth.enabled $v.auth.register (not $v.migration.enabled) -}}
{{- fail "auth.register needs migration.enabled: the migration Job registers the tokens; set auth.register=false and register them yourself (docs/DEPLOY.md \"Tokens\")" -}}
{{- end -}}
{{- if $v.nats.existingSecret -}}
{{- range $role := splitList " " (include "noetl.natsRoles" .) -}}
{{- if not (index $v.nats.urlKeys (include "noetl.roleKey" $role)) -}}
{{- fail (printf "nats.urlKeys.%s is empty: name the key of the %s role's NATS URL in nats.existingSecret" (include "noetl.roleKey" $role) $role) -}}
{{- end -}}
{{- end -}}
{{- else if not $v.nats.url -}}
{{- fail "nats.url is empty and nats.existingSecret is not set: the roles need a NATS URL" -}}
{{- end -}}
{{- end -}}

{{/* The Secrets the release reads and the keys it needs of each, as YAML:
     {<secret>: [{key: K, value: <the value naming it>}, ...]}. Secrets the chart or
     cert-manager creates are not listed. */}}
{{- define "noetl.requiredSecrets" -}}
{{- $v := .Values -}}
{{- $need := dict -}}
{{- $add := list -}}
{{- range $role := splitList " " (include "noetl.roles" .) -}}
{{- $ctx := dict "root" $ "role" $role -}}
{{- $key := include "noetl.roleKey" $role -}}
{{- $sec := include "noetl.postgresSecretName" $ctx -}}
{{- $why := ternary (printf "postgres.roleSecrets.%s" $key) "postgres.existingSecret" (hasKey $v.postgres.roleSecrets $key) -}}
{{- $add = append $add (list $sec (index $v.postgres.dsnKeys $key) (printf "%s, postgres.dsnKeys.%s" $why $key)) -}}
{{- if and $v.tls.enabled (not $v.tls.certManager.enabled) -}}
{{- $why := ternary (printf "tls.roleSecrets.%s" $key) "tls.existingSecret" (hasKey $v.tls.roleSecrets $key) -}}
{{- range $k := list "tls.crt" "tls.key" "ca.crt" -}}
{{- $add = append $add (list (include "noetl.tlsSecretName" $ctx) $k $why) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if $v.migration.enabled -}}
{{- $add = append $add (list $v.postgres.existingSecret $v.postgres.ownerDsnKey "postgres.existingSecret, postgres.ownerDsnKey") -}}
{{- end -}}
{{- if $v.postgres.ca.existingSecret -}}
{{- $add = append $add (list $v.postgres.ca.existingSecret $v.postgres.ca.key "postgres.ca.existingSecret, postgres.ca.key") -}}
{{- end -}}
{{- $add = append $add (list $v.credentials.existingSecret $v.credentials.keysKey "credentials.existingSecret, credentials.keysKey") -}}
{{- if and $v.auth.enabled $v.auth.existingSecret -}}
{{- range $k := splitList " " (include "noetl.roles" .) -}}
{{- $add = append $add (list $v.auth.existingSecret $k "auth.existingSecret") -}}
{{- end -}}
{{- if and $v.auth.register $v.auth.bootstrapAdmin -}}
{{- $add = append $add (list $v.auth.existingSecret "admin" "auth.existingSecret, auth.bootstrapAdmin") -}}
{{- end -}}
{{- end -}}
{{- range $role := splitList " " (include "noetl.natsRoles" .) -}}
{{- $key := include "noetl.roleKey" $role -}}
{{- if $v.nats.existingSecret -}}
{{- $add = append $add (list $v.nats.existingSecret (index $v.nats.urlKeys $key) (printf "nats.existingSecret, nats.urlKeys.%s" $key)) -}}
{{- end -}}
{{- if $v.nats.credsSecret -}}
{{- $add = append $add (list $v.nats.credsSecret (printf "%s.creds" $role) "nats.credsSecret") -}}
{{- end -}}
{{- end -}}
{{- if $v.nats.ca.existingSecret -}}
{{- $add = append $add (list $v.nats.ca.existingSecret $v.nats.ca.key "nats.ca.existingSecret, nats.ca.key") -}}
{{- end -}}
{{- if $v.resultStore.s3.existingSecret -}}
{{- $add = append $add (list $v.resultStore.s3.existingSecret $v.resultStore.s3.accessKeyKey "resultStore.s3.existingSecret, resultStore.s3.accessKeyKey") -}}
{{- $add = append $add (list $v.resultStore.s3.existingSecret $v.resultStore.s3.secretKeyKey "resultStore.s3.existingSecret, resultStore.s3.secretKeyKey") -}}
{{- end -}}
{{- if and $v.tracing.existingSecret (eq $v.tracing.exporter "otlp") -}}
{{- $add = append $add (list $v.tracing.existingSecret $v.tracing.headersKey "tracing.existingSecret, tracing.headersKey") -}}
{{- end -}}
{{- range $entry := $add -}}
{{- $sec := index $entry 0 -}}
{{- $have := get $need $sec | default list -}}
{{- $item := dict "key" (index $entry 1) "value" (index $entry 2) -}}
{{- if not (has $item $have) -}}
{{- $_ := set $need $sec (append $have $item) -}}
{{- end -}}
{{- end -}}
{{- toYaml $need -}}
{{- end -}}

{{/* Fail unless `secret` (a looked-up Secret, empty when missing) has every key `needs`
     lists. Context: dict "name" NAME "needs" LIST "secret" OBJECT "namespace" NS */}}
{{- define "noetl.checkSecret" -}}
{{- $values := list -}}
{{- range .needs -}}{{- $values = append $values .value -}}{{- end -}}
{{- if not .secret -}}
{{- fail (printf "Secret %q (%s) not found in namespace %q: create it first (docs/DEPLOY.md \"Security\"), or set secretChecks=false" .name (join "; " (uniq $values)) .namespace) -}}
{{- end -}}
{{- $data := merge (dict) (.secret.data | default dict) (.secret.stringData | default dict) -}}
{{- range .needs -}}
{{- if not (hasKey $data .key) -}}
{{- fail (printf "Secret %q has no key %q (%s) in namespace %q" $.name .key .value $.namespace) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* At install/upgrade (connected to a cluster: the namespace's `default` ServiceAccount
     can be looked up), check every required Secret and key; `helm template` skips it. */}}
{{- define "noetl.checkSecrets" -}}
{{- if and .Values.secretChecks (not .Values.lite.enabled) -}}
{{- if lookup "v1" "ServiceAccount" .Release.Namespace "default" -}}
{{- range $name, $needs := include "noetl.requiredSecrets" . | fromYaml -}}
{{- include "noetl.checkSecret" (dict "name" $name "needs" $needs "secret" (lookup "v1" "Secret" $.Release.Namespace $name) "namespace" $.Release.Namespace) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The port of a parsed URL (urlParse): explicit, else 443 for https, 80 for http. */}}
{{- define "noetl.urlPort" -}}
{{- $hostPort := splitList ":" .host -}}
{{- if gt (len $hostPort) 1 -}}{{ last $hostPort }}{{- else if eq .scheme "http" -}}80{{- else -}}443{{- end -}}
{{- end -}}

{{/* The migration's command (the Job's, and lite mode's init container): `noetl-rt migrate`,
     then with auth.register the release's tokens, each from its file under the auth path. */}}
{{- define "noetl.migrateCommand" -}}
{{- $paths := include "noetl.paths" . | fromYaml -}}
{{- if and .Values.auth.enabled .Values.auth.register -}}
# Each token is registered (hashed) under <fullname>-<key>-<first 12 hex of its
# SHA-256>, so a rotated token gets a new name next to the old one, which stays
# valid until revoked (docs/DEPLOY.md "Tokens"). Every upgrade registers them again:
# the runtime's refusal of a token it already has under that name is success.
command:
  - sh
  - -ec
  - |
    noetl-rt migrate
    register() {
      name="{{ include "noetl.fullname" . }}-$1-$(sha256sum < "{{ $paths.auth }}/$1" | cut -c1-12)"
      if out=$(noetl-rt token register --role "$2" --name "$name" < "{{ $paths.auth }}/$1" 2>&1); then
        echo "token $name ($2): registered"
      else
        case "$out" in
          *"a live token has that name, or the token is known"*) echo "token $name ($2): already registered" ;;
          *) echo "$out" >&2; exit 1 ;;
        esac
      fi
    }
    {{- range $role := splitList " " (include "noetl.roles" .) }}
    register {{ $role }} {{ include "noetl.tokenRole" $role }}
    {{- end }}
    {{- if .Values.auth.bootstrapAdmin }}
    register admin admin
    {{- end }}
{{- else -}}
command: ["noetl-rt", "migrate"]
{{- end }}
{{- end -}}

{{/* Lite mode's ports (every role shares the pod's network): per role its gRPC, health and
     metrics port and an index; the api's client port is ports.grpc and its WorkerService
     ports.workerApi; Postgres and NATS their usual ports on 127.0.0.1. */}}
{{- define "noetl.litePorts" -}}
postgres: 5432
nats: 4222
natsMonitor: 8222
workerApi: {{ .Values.ports.workerApi }}
{{- range $i, $role := splitList " " (include "noetl.roles" .) }}
{{ $role }}:
  index: {{ $i }}
  grpc: {{ ternary $.Values.ports.grpc (add 50060 $i) (eq $role "api") }}
  health: {{ add 50070 $i }}
  metrics: {{ add $.Values.ports.metrics $i }}
{{- end }}
{{- end -}}
