{{/* Full name of the release's objects, at most 63 characters. */}}
{{- define "conveyor.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "conveyor.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "conveyor.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "conveyor.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "conveyor.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The kopf peering object's name, or empty when the operator runs standalone (one replica). */}}
{{- define "conveyor.peering" -}}
{{- if or .Values.peering (gt (int .Values.replicaCount) 1) -}}
{{- default (include "conveyor.fullname" .) .Values.peering -}}
{{- end -}}
{{- end -}}

{{/* The server image of InferenceServices without spec.image. */}}
{{- define "conveyor.serverImage" -}}
{{- printf "%s:%s" .Values.serverImage.repository (.Values.serverImage.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* Labels of the objects the chart renders for Prometheus and Grafana (not the operator's pods). */}}
{{- define "conveyor.monitoringLabels" -}}
{{- include "conveyor.labels" . | replace "app.kubernetes.io/component: operator" "app.kubernetes.io/component: monitoring" -}}
{{- end -}}

{{/* Share of requests slower than the objective over a window: the `le` bucket at the objective
       against the count, summed over input-length buckets and pods of one InferenceService. */}}
{{- define "conveyor.slowShare" -}}
(1 - sum by (namespace, service) (rate(conveyor:{{ .metric }}_bucket{le="{{ .le }}"}[{{ .window }}]))
  / sum by (namespace, service) (rate(conveyor:{{ .metric }}_count[{{ .window }}])))
{{- end }}

{{/* A bucket bound as Prometheus' Python client labels it: `le="1.0"`, `le="0.25"`. */}}
{{- define "conveyor.le" -}}
{{- $le := printf "%v" (float64 .) -}}
{{- if contains "." $le }}{{ $le }}{{ else }}{{ $le }}.0{{ end -}}
{{- end }}

{{/* Value combinations the schema cannot express, refused with what to change. */}}
{{- define "conveyor.validate" -}}
{{- if include "conveyor.peering" . }}
{{- range .Values.watchNamespaces }}
{{- if regexMatch "[*?\\[]" . }}
{{- fail (printf "watchNamespaces: %q is a glob pattern, but peering (replicaCount > 1 or peering set) needs a KopfPeering in each namespace: list the namespaces, or run one replica" .) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and .Values.metrics.port (eq (int .Values.metrics.port) (int .Values.livenessPort)) }}
{{- fail (printf "metrics.port and livenessPort are both %v: give them different ports" .Values.livenessPort) }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.port) }}
{{- fail "metrics.serviceMonitor.enabled needs metrics.port (0 turns the operator's metrics off)" }}
{{- end }}
{{- if and (not .Values.serviceAccount.create) (not .Values.serviceAccount.name) }}
{{- fail "serviceAccount.create is false: name the existing ServiceAccount in serviceAccount.name" }}
{{- end }}
{{- end -}}

{{/* The NetworkPolicyPeers the operator admits to server pods: networkPolicy.from, and the release's
     namespace when `helm test` sends a request from there. */}}
{{- define "conveyor.networkPolicyFrom" -}}
{{- $peers := .Values.networkPolicy.from }}
{{- if .Values.helmTest.inferenceService }}
{{- $peers = append $peers (dict "namespaceSelector" (dict "matchLabels" (dict "kubernetes.io/metadata.name" .Release.Namespace))) }}
{{- end }}
{{- toJson $peers -}}
{{- end -}}
