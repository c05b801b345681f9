{{/*
Naming and labels shared by every object of the chart.
*/}}
{{- define "minicpmo.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "minicpmo.fullname" -}}
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

{{- define "minicpmo.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Name of one component's objects: <fullname>-<component>, kept within the 63-character DNS label limit. */}}
{{- define "minicpmo.componentName" -}}
{{- printf "%s-%s" (include "minicpmo.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select one component's pods; Deployment, Service, PDB and HPA all use exactly these. */}}
{{- define "minicpmo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "minicpmo.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "minicpmo.labels" -}}
helm.sh/chart: {{ include "minicpmo.chart" .root }}
{{ include "minicpmo.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: minicpmo
{{- end }}

{{- define "minicpmo.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "minicpmo.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Image of one component: <repository>:<tag>-<component>-<variant>; the gateway has no GPU variant. */}}
{{- define "minicpmo.image" -}}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag }}
{{- if eq .component "gateway" }}
{{- printf "%s:%s-gateway" .root.Values.image.repository $tag }}
{{- else }}
{{- printf "%s:%s-%s-%s" .root.Values.image.repository $tag .component .root.Values.image.variant }}
{{- end }}
{{- end }}

{{- define "minicpmo.configMapName" -}}
{{- printf "%s-deploy-profile" (include "minicpmo.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "minicpmo.modelClaimName" -}}
{{- default (printf "%s-model" (include "minicpmo.fullname" .)) .Values.model.volume.pvc.claimName }}
{{- end }}

{{- define "minicpmo.voicesClaimName" -}}
{{- default (printf "%s-voices" (include "minicpmo.fullname" .)) .Values.gateway.voices.volume.pvc.claimName }}
{{- end }}

{{/* Address the gateway dials for one stage: DNS over the headless Service, so gRPC balances per stream. */}}
{{- define "minicpmo.stageAddress" -}}
{{- $stage := index .root.Values.stages .component }}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "minicpmo.componentName" .) .root.Release.Namespace .root.Values.clusterDomain (int $stage.port) }}
{{- end }}

{{/* Seconds from the start of termination to SIGKILL: preStop sleep + drain + a margin, so the drain always completes. */}}
{{- define "minicpmo.terminationGracePeriod" -}}
{{- add (int .root.Values.preStopSleepSeconds) (int .drain) (int .root.Values.terminationGraceMarginSeconds) }}
{{- end }}

{{/* The checkpoint volume: a PersistentVolumeClaim or a node directory; always mounted read-only. */}}
{{- define "minicpmo.modelVolume" -}}
- name: model
{{- if eq .Values.model.volume.type "hostPath" }}
  hostPath:
    path: {{ .Values.model.volume.hostPath.path }}
    type: {{ .Values.model.volume.hostPath.type }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ include "minicpmo.modelClaimName" . }}
    readOnly: true
{{- end }}
{{- end }}

{{/*
A stage's health probe handler: native gRPC, or with TLS an exec of the image's probe script (Kubernetes'
gRPC probes cannot speak TLS). The script reads the TLS files from the container environment.
*/}}
{{- define "minicpmo.stageProbe" -}}
{{- if .root.Values.tls.enabled -}}
exec:
  command: ["python", "/opt/minicpmo/docker/grpc_health_probe.py", "--port", {{ .port | quote }}]
{{- else -}}
grpc:
  port: {{ .port }}
  service: ""
{{- end -}}
{{- end }}
