from django.db import models


class Order(models.Model):
    id = models.CharField(max_length=64, primary_key=True)
    quantity = models.IntegerField()
