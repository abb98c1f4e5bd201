{{/*
Names, labels and images: every template takes these from here, so a release name, a
fullnameOverride or a subchart's parent never makes two templates disagree.
*/}}

{{- define "kascade.name" -}}
{{ .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* Prefix of every object name: the release name unless fullnameOverride is set. */}}
{{- define "kascade.fullname" -}}
{{ .Values.fullnameOverride | default .Release.Name | trunc 45 | trimSuffix "-" }}
{{- end -}}

{{- define "kascade.labels" -}}
app.kubernetes.io/name: {{ include "kascade.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kascade
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Labels of every pod the chart starts (selectors are a subset and never change across versions). */}}
{{- define "kascade.podLabels" -}}
app.kubernetes.io/name: {{ include "kascade.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: kascade
{{- with .Values.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kascade.imageRef" -}}
{{- $img := index . 0 -}}{{- $root := index . 1 -}}
{{- $registry := ($root.Values.global).imageRegistry | default "" -}}
{{ if $registry }}{{ $registry }}/{{ end }}{{ $img.repository }}{{ if $img.digest }}@{{ $img.digest }}{{ else }}:{{ $img.tag | default $root.Chart.AppVersion }}{{ end }}
{{- end -}}

{{/* The operator (and router) image: slim, no torch. */}}
{{- define "kascade.image" -}}
{{ include "kascade.imageRef" (list .Values.image .) }}
{{- end -}}

{{/* The engine image (warm pool, fallback pods, the model download init container). */}}
{{- define "kascade.engineImage" -}}
{{ include "kascade.imageRef" (list .Values.pool.image .) }}
{{- end -}}

{{- define "kascade.imagePullSecrets" -}}
{{- $secrets := concat (($.Values.global).imagePullSecrets | default list) (.Values.imagePullSecrets | default list) -}}
{{- with $secrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ if kindIs "string" . }}{{ . }}{{ else }}{{ .name }}{{ end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The engine control token Secret: the one name the operator, the pool and fallback pods all use. */}}
{{- define "kascade.tokenSecret" -}}
{{ .Values.engineToken.existingSecret | default (printf "%s-engine-token" (include "kascade.fullname" .)) }}
{{- end -}}

{{/* "true" when the operator creates the token Secret (no engineToken.value nor existingSecret), else "false". */}}
{{- define "kascade.tokenCreatedByOperator" -}}
{{ and (not .Values.engineToken.value) (not .Values.engineToken.existingSecret) }}
{{- end -}}

{{/*
The warm pool's namespace as the operator is told it (KASCADE_OPERATOR_POOL_NAMESPACE) and NOTES print it:
this release's namespace when it runs the pool (the token Secret is there too), else operator.poolNamespace
("" = each ModelService's own namespace, pools installed there by pool-only releases).
*/}}
{{- define "kascade.poolNamespace" -}}
{{- $set := .Values.operator.poolNamespace -}}
{{- if .Values.pool.enabled -}}
{{- if and $set (ne $set .Release.Namespace) -}}
{{- fail (printf "operator.poolNamespace %q differs from the release namespace %q, where pool.enabled puts the pool and the token Secret: leave it empty, or install with pool.enabled=false and point it at the namespace of a pool-only release" $set .Release.Namespace) -}}
{{- end -}}
{{ .Release.Namespace }}
{{- else -}}
{{ $set }}
{{- end -}}
{{- end -}}

{{/*
Where NOTES apply the sample: the release namespace when the operator watches it (all namespaces, or
listed), else the first watched namespace (a ModelService outside them is never reconciled).
*/}}
{{- define "kascade.sampleNamespace" -}}
{{- $watch := .Values.operator.watchNamespaces | default list -}}
{{- if or (not $watch) (has .Release.Namespace $watch) -}}
{{ .Release.Namespace }}
{{- else -}}
{{ first $watch }}
{{- end -}}
{{- end -}}

{{/* Log format flag for every `kascade` entry point. */}}
{{- define "kascade.logFormatArg" -}}
--log-format={{ .Values.logFormat }}
{{- end -}}

{{/*
The front door: the Service `helm test` asks for /v1/models. The router (when the chart has one and it
is enabled), else the engines Service of this chart.
*/}}
{{- define "kascade.frontDoorUrl" -}}
{{- $router := .Values.router | default dict -}}
{{- if $router.enabled -}}
http://{{ include "kascade.fullname" . }}-router.{{ .Release.Namespace }}.svc:{{ $router.port | default 8080 }}
{{- else -}}
{{ if .Values.dataPlaneTls.secretName }}https{{ else }}http{{ end }}://{{ include "kascade.fullname" . }}-engines.{{ .Release.Namespace }}.svc:{{ .Values.pool.port }}
{{- end -}}
{{- end -}}

{{/*
dataPlaneTls: engines serve their HTTP port as HTTPS with the Secret's certificate. Clients of that port
(operator, router, helm test) mount only the Secret's ca.crt here and verify engines against it.
*/}}
{{- define "kascade.engineCaFile" -}}/etc/kascade/engine-ca/ca.crt{{- end -}}
{{- define "kascade.engineCaMount" -}}
- {name: engine-ca, mountPath: /etc/kascade/engine-ca, readOnly: true}
{{- end -}}
{{- define "kascade.engineCaVolume" -}}
- name: engine-ca
  secret: {secretName: {{ .Values.dataPlaneTls.secretName }}, items: [{key: ca.crt, path: ca.crt}]}
{{- end -}}

{{/* Restricted-profile container security context (Pod Security `restricted` admits it). */}}
{{- define "kascade.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities: {drop: [ALL]}
{{- end -}}

{{/* pool.transport ucx: UCX_TCP_PORT_RANGE of the engines (pool and fallback pods), "first-last". */}}
{{- define "kascade.ucxTcpPorts" -}}{{ .Values.pool.ucxTcpPorts.first }}-{{ .Values.pool.ucxTcpPorts.last }}{{- end -}}

{{/*
Objects of another project's API (prometheus-operator, Gateway API Inference Extension): render them only
when the cluster serves that API, else fail naming the value that asked for them. Argo CD and Flux pass the
cluster's API versions; an offline `helm template` passes them with --api-versions GROUP/VERSION/KIND.
Args: (list $ "group/version" "Kind" "the value" "what installs it").
*/}}
{{- define "kascade.requireApi" -}}
{{- $root := index . 0 }}{{ $gv := index . 1 }}{{ $kind := index . 2 }}
{{- if not ($root.Capabilities.APIVersions.Has (printf "%s/%s" $gv $kind)) -}}
{{- fail (printf "%s is set but the cluster has no %s %s (install %s first, or unset it; offline `helm template` needs --api-versions %s/%s)" (index . 3) $gv $kind (index . 4) $gv $kind) -}}
{{- end -}}
{{- end -}}

{{/*
The pool engines' capacity as the annotation kascade.io/engine-capacity carries it (the operator's
kascade_operator.capacity.annotation() writes the same form for fallback pods). maxPromptTokens 0 (the model's
context) is left out, as its flag is: a service asking for a number binds only pods started with that number.
*/}}
{{- define "kascade.engineCapacity" -}}
{{- with .Values.pool.engine -}}
kvTokens={{ int .kvTokens }},maxBatchTokens={{ int .maxBatchTokens }},{{ if gt (int .maxPromptTokens) 0 }}maxPromptTokens={{ int .maxPromptTokens }},{{ end }}maxSeqs={{ int .maxSeqs }}
{{- end -}}
{{- end -}}

{{/* The engine container's resources as JSON: pool.resources with the GPU limit (pool pods and fallback pods). */}}
{{- define "kascade.engineResources" -}}
{{- $r := deepCopy (.Values.pool.resources | default dict) -}}
{{- $limits := merge (dict "nvidia.com/gpu" .Values.pool.gpusPerPod) ($r.limits | default dict) -}}
{{- $_ := set $r "limits" $limits -}}
{{ toJson $r }}
{{- end -}}
