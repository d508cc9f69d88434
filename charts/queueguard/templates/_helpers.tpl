{{/*
The chart name, or nameOverride.
*/}}
{{- define "queueguard.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name, the prefix of every resource name: fullnameOverride, else the release name when
it already contains the chart name, else <release>-<chart name>. 63 characters at most (DNS
label).
*/}}
{{- define "queueguard.fullname" -}}
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

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "queueguard.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Selector labels: what the Deployment, the Services and the PodDisruptionBudget select pods by.
Never change them: a Deployment's selector is immutable.
*/}}
{{- define "queueguard.selectorLabels" -}}
app.kubernetes.io/name: {{ include "queueguard.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Common labels with a given component: (list $ "component").
*/}}
{{- define "queueguard.componentLabels" -}}
{{- $root := index . 0 }}
{{- $component := index . 1 -}}
helm.sh/chart: {{ include "queueguard.chart" $root }}
{{ include "queueguard.selectorLabels" $root }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/component: {{ $component }}
app.kubernetes.io/part-of: queueguard
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end }}

{{/*
Common labels of the operator's own resources.
*/}}
{{- define "queueguard.labels" -}}
{{ include "queueguard.componentLabels" (list . "operator") }}
{{- end }}

{{/*
The ServiceAccount the operator runs as.
*/}}
{{- define "queueguard.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "queueguard.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference: repository:tag (tag defaults to appVersion), or repository@sha256:... when
the tag is a digest.
*/}}
{{- define "queueguard.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion | toString }}
{{- if hasPrefix "sha256:" $tag }}
{{- printf "%s@%s" .Values.image.repository $tag }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/*
Whether the operator watches a single namespace.
*/}}
{{- define "queueguard.namespaced" -}}
{{- if eq .Values.watch.scope "Namespace" }}true{{ end }}
{{- end }}

{{/*
The namespace watched in Namespace scope: watch.namespace, else the release namespace.
*/}}
{{- define "queueguard.watchNamespace" -}}
{{- default .Release.Namespace .Values.watch.namespace }}
{{- end }}

{{/*
The leader-election Lease name.
*/}}
{{- define "queueguard.leaseName" -}}
{{- default (include "queueguard.fullname" .) .Values.leaderElection.leaseName }}
{{- end }}

{{/*
Webhook names: the MutatingWebhookConfiguration (the full name), its Service, the Secret with
the serving certificate, the cert-manager Certificate and self-signed Issuer. Service names are
DNS labels (63 characters): the full name is cut to 55 so the suffix always survives and the
webhook and metrics Services never collide.
*/}}
{{- define "queueguard.webhookConfigName" -}}
{{- include "queueguard.fullname" . }}
{{- end }}

{{- define "queueguard.webhookServiceName" -}}
{{- printf "%s-webhook" (include "queueguard.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/*
The metrics Service.
*/}}
{{- define "queueguard.metricsServiceName" -}}
{{- printf "%s-metrics" (include "queueguard.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "queueguard.webhookSecretName" -}}
{{- printf "%s-webhook-tls" (include "queueguard.fullname" .) | trunc 253 | trimSuffix "-" }}
{{- end }}

{{- define "queueguard.webhookCertificateName" -}}
{{- printf "%s-webhook" (include "queueguard.fullname" .) | trunc 253 | trimSuffix "-" }}
{{- end }}

{{- define "queueguard.selfSignedIssuerName" -}}
{{- printf "%s-selfsigned" (include "queueguard.fullname" .) | trunc 253 | trimSuffix "-" }}
{{- end }}

{{/*
Whether the operator manages the webhook's certificate itself (webhook on, cert-manager off).
*/}}
{{- define "queueguard.webhookSelfManaged" -}}
{{- if and .Values.webhook.enabled (not .Values.webhook.certManager.enabled) }}true{{ end }}
{{- end }}

{{/*
Checks of value combinations the schema cannot express. Included by the Deployment, so every
render runs them.
*/}}
{{- define "queueguard.validate" -}}
{{- if and (gt (int .Values.replicaCount) 1) (not .Values.leaderElection.enabled) }}
{{- fail "replicaCount above 1 needs leaderElection.enabled=true: without it every replica would act on the same QueuePolicies, pods and PodDisruptionBudgets at once" }}
{{- end }}
{{- if and .Values.webhook.enabled (eq (int .Values.webhook.port) 8080) }}
{{- fail "webhook.port must differ from 8080, the operator's HTTP port (/metrics, /healthz, /readyz)" }}
{{- end }}
{{- if and (eq .Values.rbac.scope "Namespaces") (include "queueguard.namespaced" .) }}
{{- fail "rbac.scope=Namespaces is for watch.scope=Cluster: with watch.scope=Namespace every right is already in that one namespace" }}
{{- end }}
{{- if and (eq .Values.rbac.scope "Namespaces") (empty .Values.rbac.namespaces) }}
{{- fail "rbac.scope=Namespaces needs rbac.namespaces: the namespaces the operator may write in" }}
{{- end }}
{{- if and .Values.webhook.enabled (include "queueguard.namespaced" .) (eq (include "queueguard.watchNamespace" .) .Release.Namespace) }}
{{- fail (printf "webhook.enabled with watch.scope=Namespace needs watch.namespace to differ from the release namespace %q: the webhook never mutates pods in its own namespace, so it would do nothing" .Release.Namespace) }}
{{- end }}
{{- end }}
