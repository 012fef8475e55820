{{- define "prime-rl.fullname" -}}
{{- printf "%s" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "prime-rl.labels" -}}
app.kubernetes.io/name: prime-rl
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "prime-rl.selector" -}}
app.kubernetes.io/name: prime-rl
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "prime-rl.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-keys" (include "prime-rl.fullname" .)) -}}
{{- end -}}

{{- define "prime-rl.hasSecret" -}}
{{- if or .Values.secrets.existingSecret .Values.secrets.inferenceApiKey .Values.secrets.wandbApiKey }}true{{ end -}}
{{- end -}}

{{/* The Secret holding the run secret (key `run-secret`): a user-given one, else the chart's (run-secret.yaml). */}}
{{- define "prime-rl.runSecretName" -}}
{{- .Values.secrets.existingRunSecret | default (printf "%s-run-secret" (include "prime-rl.fullname" .)) -}}
{{- end -}}

{{- define "prime-rl.claimName" -}}
{{- .Values.storage.existingClaim | default (printf "%s-data" (include "prime-rl.fullname" .)) -}}
{{- end -}}

{{/* The inference servers, host:port, comma-separated: one per replica, by stable pod DNS name. */}}
{{- define "prime-rl.inferenceHosts" -}}
{{- $name := include "prime-rl.fullname" . -}}
{{- $hosts := list -}}
{{- range $i := until (int .Values.inference.replicas) -}}
{{- $hosts = append $hosts (printf "%s-inference-%d.%s-inference.%s.svc.cluster.local:%d" $name $i $name $.Release.Namespace (int $.Values.inference.port)) -}}
{{- end -}}
{{- join "," $hosts -}}
{{- end -}}

{{/* rl's command line up to the role flags: the config, the shared dir, this launch's id. */}}
{{- define "prime-rl.rlArgs" -}}
- "@"
- /etc/prime-rl/rl.toml
- --output-dir
- {{ .Values.outputDir | quote }}
- --deployment.run-id
- {{ printf "%s-%d" .Release.Name .Release.Revision | quote }}
{{- if eq .Values.launcher "roles" }}
{{- $name := include "prime-rl.fullname" . }}
- --deployment.master-addr
- {{ $name }}-trainer-0.{{ $name }}-trainer
- --deployment.master-port
- {{ .Values.trainer.rendezvousPort | quote }}
{{- end }}
{{- end -}}

{{/* "[0,1,...,n-1]": the GPUs (or CPU ranks) of a container. */}}
{{- define "prime-rl.ids" -}}
[{{ join "," (until (int .)) }}]
{{- end -}}

{{/* Environment every container gets: the run secret, and the keys from the Secret (optional keys: an existing
Secret may hold one). PRIME_RL_SECRET is required: a pod whose Secret or key is missing does not start. */}}
{{- define "prime-rl.keyEnv" -}}
- name: PRIME_RL_SECRET
  valueFrom:
    secretKeyRef: {name: {{ include "prime-rl.runSecretName" . }}, key: run-secret}
{{- if include "prime-rl.hasSecret" . }}
- name: WANDB_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "prime-rl.secretName" . }}, key: wandb-api-key, optional: true}
- name: INFERENCE_SERVER_API_KEY
  valueFrom:
    secretKeyRef: {name: {{ include "prime-rl.secretName" . }}, key: inference-api-key, optional: true}
{{- end }}
{{- end -}}

{{/* Pod-level fields shared by every role: scheduling values, the shared volume, the configs, /dev/shm. */}}
{{- define "prime-rl.podCommon" -}}
{{- $v := index .root.Values .role -}}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations: {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.affinity }}
affinity: {{- toYaml . | nindent 2 }}
{{- end }}
restartPolicy: Always
volumes:
  - name: data
    persistentVolumeClaim: {claimName: {{ include "prime-rl.claimName" .root }}}
  - name: configs
    configMap: {name: {{ include "prime-rl.fullname" .root }}-configs}
  - name: shm
    emptyDir: {medium: Memory, sizeLimit: {{ .root.Values.shmSize }}}
{{- end -}}

{{- define "prime-rl.mounts" -}}
- {name: data, mountPath: {{ .Values.storage.mountPath }}}
- {name: configs, mountPath: /etc/prime-rl, readOnly: true}
- {name: shm, mountPath: /dev/shm}
{{- end -}}

{{/* resources with nvidia.com/gpu added to requests and limits when the role asks for GPUs. */}}
{{- define "prime-rl.resources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- if gt (int .gpus) 0 -}}
{{- $_ := set $res "requests" (merge (dict "nvidia.com/gpu" (int .gpus)) ($res.requests | default dict)) -}}
{{- $_ := set $res "limits" (merge (dict "nvidia.com/gpu" (int .gpus)) ($res.limits | default dict)) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}
